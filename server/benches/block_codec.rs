//! What the columnar block codec (`store::block`) stores and how fast, beside the row
//! codec (`store::codec`, one blob a step) it replaces, on the same steps in one run.
//!
//! The steps are gradflow-bench's (`bench/src/workload.rs`, compiled in here so that
//! both measure the same numbers): Qwen2.5-1.5B + agent, 230 module gradient norms,
//! 230 hook hits, 2 group norms and 57 norm weights × 4 values a step, laid out as the
//! column dictionary lays them out (kind by kind), 692 columns. Two traces: i.i.d.
//! log-normal norms (the worst case) and the realistic one (AR(1) norms with a few
//! percent to 20 % noise a step). Then the research note's two extremes, a constant
//! block and bf16-frozen weights, and a client reporting every tenth step.
//!
//! Sizes count the value blobs only (no times, no SQLite row overhead); speeds are one
//! thread, medians of several repetitions over the same blocks. The alternatives are
//! pco alone, one standalone chunk per run of one kind (a few bytes more framing than
//! the block codec's), or the whole block column-major through shuffle+zstd.
//!
//! Run: `cargo bench -p gradflow-server --bench block_codec`

use std::hint::black_box;
use std::time::Instant;

use gradflow_core::columnar::block::{self, BLOCK_STEPS, BlockRow};
use gradflow_core::columnar::codec::{self, Packed};
use gradflow_core::columnar::columns::SeriesKind;
use pco::{ChunkConfig, DeltaSpec, ModeSpec, PagingSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[allow(dead_code, unused_imports)]
#[path = "../../bench/src/workload.rs"]
mod workload;

use workload::{Generator, Shape, Trace};

const BLOCKS: u64 = 32;
const REPETITIONS: usize = 7;
const SEED: u64 = 7;

/// One stream's steps as rows of cells, with each column's kind.
struct Stream {
    steps: Vec<u64>,
    rows: Vec<Vec<u32>>,
    kinds: Vec<SeriesKind>,
}

impl Stream {
    /// `steps` steps of `trace`, keeping every `every`-th.
    fn generate(trace: Trace, steps: u64, every: u64) -> Stream {
        let shape = Shape::QWEN_1_5B;
        let names = shape.module_names();
        let mut generator = Generator::with_trace(shape, SEED, trace);
        let kept: Vec<u64> = (0..steps).step_by(every as usize).collect();
        let rows = kept
            .iter()
            .map(|&s| {
                let step = generator.step(s);
                let mut row = vec![step.loss.to_bits(), step.lr.to_bits()];
                row.extend(step.module_grad_norms.iter().map(|v| v.to_bits()));
                row.extend(std::iter::repeat_n(1.0f32.to_bits(), shape.modules));
                let mut groups = [0f64; 2];
                for (name, norm) in names.iter().zip(&step.module_grad_norms) {
                    groups[usize::from(name.starts_with("agent"))] += f64::from(*norm).powi(2);
                }
                row.extend(groups.map(|g| (g.sqrt() as f32).to_bits()));
                for field in 0..4 {
                    row.extend(step.params.iter().map(|p| p[field].to_bits()));
                }
                row
            })
            .collect();
        let mut kinds = vec![SeriesKind::Loss, SeriesKind::Lr];
        kinds.extend(std::iter::repeat_n(
            SeriesKind::ModuleGradNorm,
            shape.modules,
        ));
        kinds.extend(std::iter::repeat_n(SeriesKind::HookHits, shape.modules));
        kinds.extend([SeriesKind::GroupGradNorm; 2]);
        for kind in [
            SeriesKind::ParamGradNorm,
            SeriesKind::UpdateNorm,
            SeriesKind::Drift,
            SeriesKind::ParamMean,
        ] {
            kinds.extend(std::iter::repeat_n(kind, shape.norm_params));
        }
        Stream {
            steps: kept,
            rows,
            kinds,
        }
    }

    /// `columns` columns of one kind, `make(step, column)` each.
    fn uniform(columns: usize, make: impl FnMut(u64, usize) -> f32) -> Stream {
        let mut make = make;
        let steps: Vec<u64> = (0..BLOCKS * BLOCK_STEPS).collect();
        let rows = steps
            .iter()
            .map(|&s| (0..columns).map(|c| make(s, c).to_bits()).collect())
            .collect();
        Stream {
            steps,
            rows,
            kinds: vec![SeriesKind::ParamMean; columns],
        }
    }

    fn values(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// The block-codec inputs, block by block.
    fn blocks(&self) -> Vec<(u64, Vec<BlockRow<'_>>)> {
        let mut blocks: Vec<(u64, Vec<BlockRow<'_>>)> = Vec::new();
        for (step, cells) in self.steps.iter().zip(&self.rows) {
            let index = block::block_index(*step);
            let row = BlockRow {
                step: *step,
                time: None,
                cells,
            };
            match blocks.last_mut() {
                Some((last, rows)) if *last == index => rows.push(row),
                _ => blocks.push((index, vec![row])),
            }
        }
        blocks
    }
}

/// Bytes, and encode and decode seconds (medians).
struct Measured {
    bytes: usize,
    encode: f64,
    decode: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Times `encode` over every input and `decode` over every output, `REPETITIONS` times.
fn measure<I, B: AsRef<[u8]>>(
    inputs: &[I],
    encode: impl Fn(&I) -> B,
    decode: impl Fn(&[u8]) -> u64,
) -> Measured {
    let (mut encodes, mut decodes) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..REPETITIONS {
        let start = Instant::now();
        let blobs: Vec<B> = inputs.iter().map(|i| black_box(encode(i))).collect();
        encodes.push(start.elapsed().as_secs_f64());
        bytes = blobs.iter().map(|b| b.as_ref().len()).sum();
        let start = Instant::now();
        for blob in &blobs {
            black_box(decode(blob.as_ref()));
        }
        decodes.push(start.elapsed().as_secs_f64());
    }
    Measured {
        bytes,
        encode: median(encodes),
        decode: median(decodes),
    }
}

fn row_codec(stream: &Stream) -> Measured {
    let compressor = std::cell::RefCell::new(codec::compressor().unwrap());
    let decompressor = std::cell::RefCell::new(codec::decompressor().unwrap());
    measure(
        &stream.rows,
        |row| codec::encode(row, &mut compressor.borrow_mut()).unwrap(),
        |blob| {
            let packed = Packed::decode(blob, &mut decompressor.borrow_mut()).unwrap();
            (0..packed.column_count())
                .map(|c| u64::from(packed.bits(c)))
                .sum()
        },
    )
}

fn block_codec(stream: &Stream, by_kind: bool) -> Measured {
    let no_kinds: &[SeriesKind] = &[];
    let kinds = if by_kind { &stream.kinds[..] } else { no_kinds };
    measure(
        &stream.blocks(),
        |(index, rows)| block::encode(*index, rows, kinds).unwrap(),
        |blob| {
            let block = block::decode(blob).unwrap();
            (0..block.column_count())
                .map(|c| {
                    block
                        .column(c)
                        .unwrap()
                        .iter()
                        .map(|&b| u64::from(b))
                        .sum::<u64>()
                })
                .sum()
        },
    )
}

/// The cells of each block column-major, and the widths of its runs of one kind.
fn column_major(stream: &Stream) -> Vec<(usize, Vec<f32>, Vec<usize>)> {
    stream
        .blocks()
        .into_iter()
        .map(|(_, rows)| {
            let columns = rows.iter().map(|r| r.cells.len()).max().unwrap_or(0);
            let n = rows.len();
            let mut values = vec![f32::NAN; columns * n];
            for (i, row) in rows.iter().enumerate() {
                for (c, &bits) in row.cells.iter().enumerate() {
                    values[c * n + i] = f32::from_bits(bits);
                }
            }
            let mut widths: Vec<usize> = Vec::new();
            for c in 0..columns {
                match widths.last_mut() {
                    Some(w) if c > 0 && stream.kinds[c] == stream.kinds[c - 1] => *w += 1,
                    _ => widths.push(1),
                }
            }
            (n, values, widths)
        })
        .collect()
}

/// pco per run of one kind with `config`, as f32 or as the cells' u32 bits.
fn pco_alternative(stream: &Stream, config: &ChunkConfig, as_bits: bool) -> Measured {
    let blocks = column_major(stream);
    let compress = |values: &[f32]| -> Vec<u8> {
        let config = config
            .clone()
            .with_paging_spec(PagingSpec::Exact(vec![values.len()]));
        if as_bits {
            let bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
            pco::standalone::simple_compress(&bits, &config).unwrap()
        } else {
            pco::standalone::simple_compress(values, &config).unwrap()
        }
    };
    let inputs: Vec<(usize, &[f32], &[usize])> = blocks
        .iter()
        .map(|(n, values, widths)| (*n, &values[..], &widths[..]))
        .collect();
    measure(
        &inputs,
        |(n, values, widths)| {
            // Length-prefixed segments: enough to split them again.
            let mut out = Vec::new();
            let mut start = 0;
            for width in widths.iter() {
                let chunk = compress(&values[start * n..(start + width) * n]);
                out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
                out.extend_from_slice(&chunk);
                start += width;
            }
            out
        },
        |mut blob| {
            let mut sum = 0u64;
            while !blob.is_empty() {
                let len = u32::from_le_bytes(blob[..4].try_into().unwrap()) as usize;
                let chunk = &blob[4..4 + len];
                sum += if as_bits {
                    pco::standalone::simple_decompress::<u32>(chunk).unwrap()[0] as u64
                } else {
                    pco::standalone::simple_decompress::<f32>(chunk).unwrap()[0].to_bits() as u64
                };
                blob = &blob[4 + len..];
            }
            sum
        },
    )
}

/// The whole block byte-shuffled and zstd-compressed at level 1, column-major.
fn zstd_alternative(stream: &Stream) -> Measured {
    let blocks = column_major(stream);
    let compressor = std::cell::RefCell::new(zstd::bulk::Compressor::new(1).unwrap());
    let decompressor = std::cell::RefCell::new(zstd::bulk::Decompressor::new().unwrap());
    let sizes: Vec<usize> = blocks.iter().map(|(_, v, _)| v.len() * 4).collect();
    let inputs: Vec<(&[f32], usize)> = blocks.iter().map(|(_, v, _)| &v[..]).zip(sizes).collect();
    measure(
        &inputs,
        |(values, size)| {
            let n = values.len();
            let mut planes = vec![0u8; *size];
            for (i, v) in values.iter().enumerate() {
                for (p, byte) in v.to_bits().to_le_bytes().into_iter().enumerate() {
                    planes[p * n + i] = byte;
                }
            }
            let mut blob = (n as u32).to_le_bytes().to_vec();
            blob.extend(compressor.borrow_mut().compress(&planes).unwrap());
            blob
        },
        |blob| {
            let n = u32::from_le_bytes(blob[..4].try_into().unwrap()) as usize;
            let planes = decompressor
                .borrow_mut()
                .decompress(&blob[4..], n * 4)
                .unwrap();
            (0..n)
                .map(|i| {
                    u64::from(u32::from_le_bytes([
                        planes[i],
                        planes[n + i],
                        planes[2 * n + i],
                        planes[3 * n + i],
                    ]))
                })
                .sum()
        },
    )
}

fn pco_config(level: usize) -> ChunkConfig {
    ChunkConfig::default().with_compression_level(level)
}

fn report(label: &str, stream: &Stream, measured: &Measured, modules: usize) {
    let values = stream.values() as f64;
    let per_module_norm = if modules > 0 {
        format!(
            "{:6.2} B/module norm",
            measured.bytes as f64 / (stream.steps.len() * modules) as f64
        )
    } else {
        String::new()
    };
    println!(
        "  {label:<44} {:6.3} B/value {per_module_norm}  encode {:6.1} M values/s  decode {:6.1} M values/s",
        measured.bytes as f64 / values,
        values / measured.encode / 1e6,
        values / measured.decode / 1e6,
    );
}

fn main() {
    let modules = Shape::QWEN_1_5B.modules;
    for (name, trace) in [("i.i.d.", Trace::Iid), ("realistic", Trace::Realistic)] {
        let stream = Stream::generate(trace, BLOCKS * BLOCK_STEPS, 1);
        println!(
            "{name} trace: {} steps x {} columns, {BLOCKS} blocks of {BLOCK_STEPS}",
            stream.steps.len(),
            stream.kinds.len()
        );
        report(
            "row codec (shuffle+zstd-1 a step)",
            &stream,
            &row_codec(&stream),
            modules,
        );
        report(
            "block codec (pco 4 by kind; chosen)",
            &stream,
            &block_codec(&stream, true),
            modules,
        );
        report(
            "block codec, one segment (no kinds)",
            &stream,
            &block_codec(&stream, false),
            modules,
        );
        report(
            "  alt: pco 8 by kind",
            &stream,
            &pco_alternative(&stream, &pco_config(8), false),
            modules,
        );
        report(
            "  alt: pco 4 by kind, u32 bits",
            &stream,
            &pco_alternative(&stream, &pco_config(4), true),
            modules,
        );
        report(
            "  alt: pco 4 by kind, classic mode, no delta",
            &stream,
            &pco_alternative(
                &stream,
                &pco_config(4)
                    .with_mode_spec(ModeSpec::Classic)
                    .with_delta_spec(DeltaSpec::NoOp),
                false,
            ),
            modules,
        );
        report(
            "  alt: pco 4 by kind, classic mode, auto delta",
            &stream,
            &pco_alternative(
                &stream,
                &pco_config(4).with_mode_spec(ModeSpec::Classic),
                false,
            ),
            modules,
        );
        report(
            "  alt: whole block shuffle+zstd-1",
            &stream,
            &zstd_alternative(&stream),
            modules,
        );
    }

    let sparse = Stream::generate(Trace::Realistic, BLOCKS * BLOCK_STEPS * 10, 10);
    println!(
        "realistic trace, every 10th step: {} steps x {} columns, ~{} steps a block",
        sparse.steps.len(),
        sparse.kinds.len(),
        BLOCK_STEPS / 10
    );
    report("row codec", &sparse, &row_codec(&sparse), modules);
    report("block codec", &sparse, &block_codec(&sparse, true), modules);

    println!("columns of one kind (the research note's extremes, and counts):");
    let constant = Stream::uniform(230, |_, _| 1.0);
    report(
        "constant 1.0: row codec",
        &constant,
        &row_codec(&constant),
        0,
    );
    report(
        "constant 1.0: block codec",
        &constant,
        &block_codec(&constant, true),
        0,
    );
    // A bf16 weight stuck at 1.0 that moves by ±2^-8 with probability 1 % a step.
    let mut rng = StdRng::seed_from_u64(SEED);
    let mut weights = vec![1.0f32; 230];
    let frozen = Stream::uniform(230, |_, c| {
        if rng.gen_bool(0.01) {
            weights[c] += if rng.gen_bool(0.5) { 1.0 } else { -1.0 } / 256.0;
        }
        weights[c]
    });
    report("bf16-frozen: row codec", &frozen, &row_codec(&frozen), 0);
    report(
        "bf16-frozen: block codec",
        &frozen,
        &block_codec(&frozen, true),
        0,
    );
    // Whole-number counts (a norm weight's elements rounded away, of 1536).
    let counts = Stream::uniform(57, |_, _| rng.gen_range(0..1536) as f32);
    report("counts: row codec", &counts, &row_codec(&counts), 0);
    report(
        "counts: block codec",
        &counts,
        &block_codec(&counts, true),
        0,
    );
    report(
        "counts:   alt: pco 4, u32 bits",
        &counts,
        &pco_alternative(&counts, &pco_config(4), true),
        0,
    );
    report(
        "counts:   alt: pco 4, classic mode",
        &counts,
        &pco_alternative(
            &counts,
            &pco_config(4).with_mode_spec(ModeSpec::Classic),
            false,
        ),
        0,
    );

    let stream = Stream::generate(Trace::Realistic, BLOCK_STEPS, 1);
    let blocks = stream.blocks();
    let (index, rows) = &blocks[0];
    let timed: Vec<BlockRow<'_>> = rows
        .iter()
        .map(|r| BlockRow {
            time: Some(1.7e9 + r.step as f64 * 0.35 + (r.step % 3) as f64 * 1e-3),
            ..*r
        })
        .collect();
    let without = block::encode(*index, rows, &stream.kinds).unwrap().len();
    let with = block::encode(*index, &timed, &stream.kinds).unwrap().len();
    println!(
        "timestamps (0.35 s apart, ms jitter): {:.2} B a step",
        (with - without) as f64 / rows.len() as f64
    );
}
