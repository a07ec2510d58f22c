//! A block of one stream's steps, stored column-major and compressed as a whole.
//!
//! Block `k` of a stream holds steps `64k..64k+63`. Steps may be sparse (a client
//! reporting every tenth step fills six or seven of them), so a `u64` mask says which
//! are present. Each present step has its client timestamp and its row of cells, one
//! `u32` per column of the run's column dictionary (`codec.rs` says what the bits
//! mean). Rows may be shorter than the block: columns are added as a run goes, and a
//! missing tail reads as [`ABSENT_BITS`].
//!
//! Rows compressed one by one (`codec.rs`) cannot use what neighbouring steps share.
//! Here each column's values for the block's present steps are laid out contiguously
//! and compressed with pco, a numeric codec that gets within ~0.1 B of the entropy of
//! noisy floats and turns constant or slowly moving columns into almost nothing.
//!
//! pco fits one distribution of values per chunk, so a chunk mixing module gradient
//! norms, hook hits of 1, update norms around 1e-4 and weight means near 1.0 costs
//! ~12–14 % more than one chunk per kind. The caller therefore labels each column with
//! its family (its series kind); each run of neighbouring columns of one family is
//! a segment, compressed on its own. The column dictionary hands out a kind's columns
//! together, so a run's first step fixes a handful of segments.
//!
//! A segment is stored raw when that is smaller: pco's per-chunk metadata costs tens
//! of bytes, more than a one-step block or a one-column family is worth. Neighbouring
//! raw segments are merged. (Byte-shuffle + zstd, as a row blob is packed, was never
//! smaller than the better of pco and raw in `benches/block_codec.rs`, on blocks of 1
//! to 64 steps, so it is not a codec here.)
//!
//! # Blob layout (format 1)
//!
//! ```text
//! u8      format = 1
//! u8      times codec: 0 none, 1 raw, 2 pco
//! u32 LE  CRC-32 (IEEE) of every byte after this field
//! varint  block index k
//! u64 LE  mask: bit i set ⇔ step 64k+i is present
//! varint  column count
//! varint  segment count
//! times, unless their codec is none:
//!   u64 LE  bit j set ⇔ the j-th present step has a time
//!   varint  payload length, then the payload: those times as f64
//! each segment:
//!   u8      codec: 1 raw (u32 LE cells), 2 pco (f32)
//!   varint  column count
//!   varint  payload length, then the payload: its cells, column after column
//! ```
//!
//! Varints are LEB128, so a small block's header is ~20 bytes. The checksum makes a
//! corrupt or truncated blob an error rather than wrong numbers; it costs four bytes
//! and one pass over the blob (a few percent of decoding).

use std::ops::{Bound, RangeBounds};

use anyhow::{Context, bail, ensure};
use pco::data_types::Number;
use pco::wrapped::{FileCompressor, FileDecompressor};
use pco::{ChunkConfig, PagingSpec};

use super::codec::{ABSENT_BITS, Cell};

/// Steps per block.
pub const BLOCK_STEPS: u64 = 64;

const FORMAT: u8 = 1;
const CHECKSUMMED_FROM: usize = 6;
/// Far beyond any model's column count; keeps a blob that lies about its size from
/// asking for gigabytes.
const MAX_COLUMNS: usize = 1 << 20;

/// A section's codec.
const TAG_NONE: u8 = 0;
const TAG_RAW: u8 = 1;
const TAG_PCO: u8 = 2;

/// pco's compression level, chosen in `benches/block_codec.rs`: level 8 is 0.7–3 %
/// smaller and 2–3× slower to encode.
const PCO_LEVEL: usize = 4;

/// The block holding `step`.
pub fn block_index(step: u64) -> u64 {
    step / BLOCK_STEPS
}

/// The first step of block `index`.
pub fn first_step(index: u64) -> u64 {
    index * BLOCK_STEPS
}

/// How many of a block's present steps lie in `range`, from its mask alone.
pub fn present_in(index: u64, mask: u64, range: impl RangeBounds<u64>) -> u32 {
    let first = first_step(index);
    let last = first + (BLOCK_STEPS - 1);
    let low = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&u64::MAX) => return 0,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let high = match range.end_bound() {
        Bound::Included(&e) => e,
        Bound::Excluded(&0) => return 0,
        Bound::Excluded(&e) => e - 1,
        Bound::Unbounded => u64::MAX,
    };
    let (low, high) = (low.max(first), high.min(last));
    if low > high {
        return 0;
    }
    let width = high - low + 1;
    let window = if width == BLOCK_STEPS {
        u64::MAX
    } else {
        (1u64 << width) - 1
    };
    ((mask >> (low - first)) & window).count_ones()
}

/// One present step of a block, as written.
#[derive(Debug, Clone, Copy)]
pub struct BlockRow<'a> {
    /// The absolute step number.
    pub step: u64,
    /// The client's timestamp, Unix seconds.
    pub time: Option<f64>,
    /// One cell per column; a short row's missing tail is absent.
    pub cells: &'a [u32],
}

/// Packs block `index`'s present steps, in ascending order, into a blob.
///
/// `families[c]` labels column `c` (its series kind, say): neighbouring columns of one
/// family are compressed together, and columns past the end of `families` form one
/// family. Any labelling decodes the same; it only changes the size.
pub fn encode<F: PartialEq>(
    index: u64,
    rows: &[BlockRow<'_>],
    families: &[F],
) -> anyhow::Result<Vec<u8>> {
    ensure!(
        index <= block_index(u64::MAX),
        "block index {index} is past the last step"
    );
    let first = first_step(index);
    let mut mask = 0u64;
    for (i, row) in rows.iter().enumerate() {
        ensure!(
            block_index(row.step) == index,
            "step {} is not in block {index}",
            row.step
        );
        if i > 0 {
            let previous = rows[i - 1].step;
            ensure!(
                row.step > previous,
                "steps must ascend: {} follows {previous}",
                row.step
            );
        }
        mask |= 1 << (row.step - first);
    }
    let columns = rows.iter().map(|r| r.cells.len()).max().unwrap_or(0);
    ensure!(
        columns <= MAX_COLUMNS,
        "a block of {columns} columns is over the limit of {MAX_COLUMNS}"
    );

    let present = rows.len();
    // Column-major, so each column's steps sit together. As f32, not as u32 bits:
    // pco then orders values by magnitude across the sign and finds float structure
    // (whole-number counts take 12 % less than as bits); every bit pattern survives.
    let mut values = vec![f32::from_bits(ABSENT_BITS); columns * present];
    for (c, column) in values.chunks_exact_mut(present.max(1)).enumerate() {
        for (cell, row) in column.iter_mut().zip(rows) {
            if let Some(&bits) = row.cells.get(c) {
                *cell = f32::from_bits(bits);
            }
        }
    }

    let mut segments: Vec<(u8, usize, Vec<u8>)> = Vec::new();
    let mut start = 0;
    for width in family_runs(columns, families) {
        let cells = &values[start * present..(start + width) * present];
        let (tag, payload) = encode_segment(cells)?;
        match segments.last_mut() {
            Some((TAG_RAW, merged, raw)) if tag == TAG_RAW => {
                *merged += width;
                raw.extend_from_slice(&payload);
            }
            _ => segments.push((tag, width, payload)),
        }
        start += width;
    }

    let (times_tag, times) = encode_times(rows)?;
    let payloads: usize = segments.iter().map(|(_, _, p)| p.len() + 11).sum();
    let mut blob = Vec::with_capacity(32 + times.len() + payloads);
    blob.push(FORMAT);
    blob.push(times_tag);
    blob.extend_from_slice(&[0; 4]);
    put_varint(&mut blob, index);
    blob.extend_from_slice(&mask.to_le_bytes());
    put_varint(&mut blob, columns as u64);
    put_varint(&mut blob, segments.len() as u64);
    blob.extend_from_slice(&times);
    for (tag, width, payload) in &segments {
        blob.push(*tag);
        put_varint(&mut blob, *width as u64);
        put_varint(&mut blob, payload.len() as u64);
        blob.extend_from_slice(payload);
    }
    let checksum = crc32fast::hash(&blob[CHECKSUMMED_FROM..]);
    blob[2..CHECKSUMMED_FROM].copy_from_slice(&checksum.to_le_bytes());
    Ok(blob)
}

/// The widths of the runs of neighbouring columns of one family.
fn family_runs<F: PartialEq>(columns: usize, families: &[F]) -> Vec<usize> {
    let mut runs: Vec<usize> = Vec::new();
    for c in 0..columns {
        let same = c > 0 && families.get(c) == families.get(c - 1);
        match runs.last_mut() {
            Some(width) if same => *width += 1,
            _ => runs.push(1),
        }
    }
    runs
}

/// The times section: which present steps have a time, and those times.
fn encode_times(rows: &[BlockRow<'_>]) -> anyhow::Result<(u8, Vec<u8>)> {
    let times: Vec<f64> = rows.iter().filter_map(|r| r.time).collect();
    if times.is_empty() {
        return Ok((TAG_NONE, Vec::new()));
    }
    let which = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.time.is_some())
        .fold(0u64, |bits, (j, _)| bits | 1 << j);
    // Timestamps a few milliseconds to seconds apart share their high bits, which
    // pco's delta encoding finds; raw wins only for a handful of them.
    let packed = pco_compress(&times)?;
    let (tag, payload) = if packed.len() < times.len() * 8 {
        (TAG_PCO, packed)
    } else {
        (
            TAG_RAW,
            times.iter().flat_map(|t| t.to_le_bytes()).collect(),
        )
    };
    let mut section = Vec::with_capacity(18 + payload.len());
    section.extend_from_slice(&which.to_le_bytes());
    put_varint(&mut section, payload.len() as u64);
    section.extend_from_slice(&payload);
    Ok((tag, section))
}

/// pco, or the raw bits where they are no larger.
fn encode_segment(cells: &[f32]) -> anyhow::Result<(u8, Vec<u8>)> {
    let packed = pco_compress(cells)?;
    Ok(if packed.len() < cells.len() * 4 {
        (TAG_PCO, packed)
    } else {
        (
            TAG_RAW,
            cells
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
        )
    })
}

fn pco_compress<T: Number>(values: &[T]) -> anyhow::Result<Vec<u8>> {
    let config = ChunkConfig::default()
        .with_compression_level(PCO_LEVEL)
        // One page: the block's size is known, and pages would repeat metadata.
        .with_paging_spec(PagingSpec::Exact(vec![values.len()]));
    let file = FileCompressor::default();
    let mut out = Vec::new();
    file.write_header(&mut out)
        .context("writing pco's header")?;
    let mut chunk = file
        .chunk_compressor(values, &config)
        .context("compressing a block with pco")?;
    chunk
        .write_meta(&mut out)
        .context("writing pco's metadata")?;
    chunk
        .write_page(0, &mut out)
        .context("writing pco's page")?;
    Ok(out)
}

/// LEB128: seven bits a byte, low bits first.
fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// What a blob says about its block before anything is decompressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub index: u64,
    pub mask: u64,
    pub column_count: usize,
}

impl BlockHeader {
    /// Present steps.
    pub fn len(&self) -> usize {
        self.mask.count_ones() as usize
    }

    pub fn is_empty(&self) -> bool {
        self.mask == 0
    }
}

/// Reads a blob's header, checking its checksum but decompressing nothing.
pub fn peek(blob: &[u8]) -> anyhow::Result<BlockHeader> {
    Ok(checked_header(blob)?.0)
}

fn checked_header(blob: &[u8]) -> anyhow::Result<(BlockHeader, Reader<'_>)> {
    ensure!(
        blob.len() > CHECKSUMMED_FROM,
        "block blob of {} bytes is shorter than its header",
        blob.len()
    );
    ensure!(
        blob[0] == FORMAT,
        "block blob has unknown format {}",
        blob[0]
    );
    let checksum = u32::from_le_bytes(blob[2..CHECKSUMMED_FROM].try_into()?);
    ensure!(
        crc32fast::hash(&blob[CHECKSUMMED_FROM..]) == checksum,
        "block blob is corrupt: its checksum does not match"
    );
    let mut reader = Reader(&blob[CHECKSUMMED_FROM..]);
    let index = reader.varint()?;
    let mask = reader.u64()?;
    let column_count = reader.varint()?;
    ensure!(
        index <= block_index(u64::MAX),
        "block blob has an impossible index {index}"
    );
    ensure!(
        column_count <= MAX_COLUMNS as u64,
        "block blob claims {column_count} columns"
    );
    Ok((
        BlockHeader {
            index,
            mask,
            column_count: column_count as usize,
        },
        reader,
    ))
}

/// Unpacks a blob written by [`encode`].
pub fn decode(blob: &[u8]) -> anyhow::Result<DecodedBlock> {
    let (header, mut reader) = checked_header(blob)?;
    let present = header.len();
    let columns = header.column_count;
    let segment_count = reader.varint()?;
    ensure!(
        segment_count <= columns as u64,
        "block blob has {segment_count} segments for {columns} columns"
    );
    let times = decode_times(blob[1], &mut reader, present)?;

    let mut values = vec![0f32; columns * present];
    let mut start = 0;
    for _ in 0..segment_count {
        let tag = reader.u8()?;
        let width = reader.varint()?;
        ensure!(
            width > 0 && width <= (columns - start) as u64,
            "block segment of {width} columns overruns the block's {columns}"
        );
        let width = width as usize;
        let payload = reader.payload()?;
        let cells = &mut values[start * present..(start + width) * present];
        decode_segment(tag, payload, cells)?;
        start += width;
    }
    ensure!(
        start == columns,
        "block blob's segments hold {start} of its {columns} columns"
    );
    ensure!(
        reader.0.is_empty(),
        "block blob has {} bytes after its last segment",
        reader.0.len()
    );

    let first = first_step(header.index);
    let steps = (0..BLOCK_STEPS)
        .filter(|i| header.mask & (1 << i) != 0)
        .map(|i| first + i)
        .collect();
    Ok(DecodedBlock {
        index: header.index,
        mask: header.mask,
        steps,
        times,
        columns,
        // Reuses the allocation: f32 and u32 have one layout.
        cells: values.into_iter().map(f32::to_bits).collect(),
    })
}

fn decode_times(
    tag: u8,
    reader: &mut Reader<'_>,
    present: usize,
) -> anyhow::Result<Vec<Option<f64>>> {
    if tag == TAG_NONE {
        return Ok(vec![None; present]);
    }
    let which = reader.u64()?;
    ensure!(
        present == 64 || which >> present == 0,
        "block blob has times for steps it does not hold"
    );
    let payload = reader.payload()?;
    let mut times = vec![0f64; which.count_ones() as usize];
    match tag {
        TAG_RAW => {
            ensure!(
                payload.len() == times.len() * 8,
                "block blob's raw times are {} bytes for {} times",
                payload.len(),
                times.len()
            );
            for (time, bytes) in times.iter_mut().zip(payload.chunks_exact(8)) {
                *time = f64::from_le_bytes(bytes.try_into()?);
            }
        }
        TAG_PCO => pco_decompress(payload, &mut times).context("decoding a block's times")?,
        other => bail!("block blob has unknown times codec {other}"),
    }
    let mut times = times.into_iter();
    Ok((0..present)
        .map(|j| {
            if which & (1 << j) != 0 {
                times.next()
            } else {
                None
            }
        })
        .collect())
}

fn decode_segment(tag: u8, payload: &[u8], cells: &mut [f32]) -> anyhow::Result<()> {
    match tag {
        TAG_PCO => pco_decompress(payload, cells).context("decoding a block segment"),
        TAG_RAW => {
            ensure!(
                payload.len() == cells.len() * 4,
                "raw block segment of {} bytes for {} cells",
                payload.len(),
                cells.len()
            );
            for (cell, bytes) in cells.iter_mut().zip(payload.chunks_exact(4)) {
                *cell = f32::from_bits(u32::from_le_bytes(bytes.try_into()?));
            }
            Ok(())
        }
        other => bail!("block segment has unknown codec {other}"),
    }
}

fn pco_decompress<T: Number>(payload: &[u8], out: &mut [T]) -> anyhow::Result<()> {
    let (file, rest) = FileDecompressor::new(payload)?;
    let (mut chunk, rest) = file.chunk_decompressor::<T, _>(rest)?;
    let mut page = chunk.page_decompressor(rest, out.len())?;
    let progress = page.read(out)?;
    ensure!(
        progress.finished && progress.n_processed == out.len(),
        "pco decoded {} of {} values",
        progress.n_processed,
        out.len()
    );
    // A page decoded with the wrong count stops early or runs dry; the first only
    // shows as bytes left over.
    let rest = page.into_src();
    ensure!(
        rest.is_empty(),
        "pco left {} bytes of its page undecoded",
        rest.len()
    );
    Ok(())
}

/// Fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> anyhow::Result<&'a [u8]> {
        ensure!(
            self.0.len() >= len,
            "block blob ends {} bytes early",
            len - self.0.len()
        );
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(taken)
    }

    fn u8(&mut self) -> anyhow::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> anyhow::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }

    fn varint(&mut self) -> anyhow::Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            ensure!(
                shift < 63 || byte <= 1,
                "block blob has a varint past 64 bits"
            );
            value |= u64::from(byte & 0x7F) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        bail!("block blob has a varint past 64 bits")
    }

    /// A varint length, then that many bytes.
    fn payload(&mut self) -> anyhow::Result<&'a [u8]> {
        let len = self.varint()?;
        ensure!(
            len <= self.0.len() as u64,
            "block blob ends {} bytes early",
            len - self.0.len() as u64
        );
        self.take(len as usize)
    }
}

/// A decoded block: each column's cells contiguous, one per present step.
#[derive(Debug, Clone)]
pub struct DecodedBlock {
    index: u64,
    mask: u64,
    steps: Vec<u64>,
    times: Vec<Option<f64>>,
    columns: usize,
    cells: Vec<u32>,
}

impl DecodedBlock {
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Bit `i` set ⇔ step `64·index + i` is present.
    pub fn mask(&self) -> u64 {
        self.mask
    }

    /// The present steps, ascending (absolute step numbers).
    pub fn steps(&self) -> &[u64] {
        &self.steps
    }

    /// Present steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Where `step` is among the present steps, if it is one.
    pub fn position(&self, step: u64) -> Option<usize> {
        if block_index(step) != self.index {
            return None;
        }
        let bit = step - first_step(self.index);
        if self.mask & (1 << bit) == 0 {
            return None;
        }
        Some((self.mask & ((1 << bit) - 1)).count_ones() as usize)
    }

    /// The client's timestamps, one per present step.
    pub fn times(&self) -> &[Option<f64>] {
        &self.times
    }

    /// Columns stored; any column past them is absent on every step.
    pub fn column_count(&self) -> usize {
        self.columns
    }

    /// The cells of `column`, one per present step; `None` past the stored columns
    /// (all absent).
    pub fn column(&self, column: usize) -> Option<&[u32]> {
        let n = self.steps.len();
        (column < self.columns).then(|| &self.cells[column * n..(column + 1) * n])
    }

    /// The cell of the `position`-th present step in `column`.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](Self::len).
    pub fn bits(&self, position: usize, column: usize) -> u32 {
        assert!(
            position < self.steps.len(),
            "position {position} of a block of {} steps",
            self.steps.len()
        );
        self.column(column)
            .map_or(ABSENT_BITS, |cells| cells[position])
    }

    pub fn cell(&self, position: usize, column: usize) -> Cell {
        Cell::from_bits(self.bits(position, column))
    }

    /// `(step, bits)` of `column` for every present step, ascending.
    pub fn column_steps(&self, column: usize) -> impl Iterator<Item = (u64, u32)> + '_ {
        let cells = self.column(column);
        self.steps
            .iter()
            .enumerate()
            .map(move |(i, &step)| (step, cells.map_or(ABSENT_BITS, |c| c[i])))
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::columnar::codec::NULL_BITS;

    /// Written and read back: every cell's bits, the steps and the times.
    fn round_trip<F: PartialEq>(index: u64, rows: &[BlockRow<'_>], families: &[F]) -> Vec<u8> {
        let blob = encode(index, rows, families).unwrap();
        let block = decode(&blob).unwrap();
        let columns = rows.iter().map(|r| r.cells.len()).max().unwrap_or(0);
        assert_eq!(block.index(), index);
        assert_eq!(block.len(), rows.len());
        assert_eq!(block.column_count(), columns);
        let steps: Vec<u64> = rows.iter().map(|r| r.step).collect();
        assert_eq!(block.steps(), steps);
        let mask = steps
            .iter()
            .fold(0u64, |m, s| m | 1 << (s - first_step(index)));
        assert_eq!(block.mask(), mask);
        assert_eq!(peek(&blob).unwrap().mask, mask);
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(block.position(row.step), Some(i));
            assert_eq!(
                block.times()[i].map(f64::to_bits),
                row.time.map(f64::to_bits),
                "time of step {}",
                row.step
            );
            for c in 0..columns + 2 {
                let expected = row.cells.get(c).copied().unwrap_or(ABSENT_BITS);
                assert_eq!(
                    block.bits(i, c),
                    expected,
                    "step {} column {c}: {:#010x} for {expected:#010x}",
                    row.step,
                    block.bits(i, c)
                );
            }
        }
        for c in 0..columns {
            let from_rows: Vec<(u64, u32)> = rows
                .iter()
                .map(|r| (r.step, r.cells.get(c).copied().unwrap_or(ABSENT_BITS)))
                .collect();
            assert_eq!(block.column_steps(c).collect::<Vec<_>>(), from_rows);
            assert_eq!(
                block.column(c).unwrap(),
                from_rows.iter().map(|(_, b)| *b).collect::<Vec<_>>()
            );
        }
        assert!(block.column(columns).is_none());
        blob
    }

    fn rows_of<'a>(
        steps: &[u64],
        cells: &'a [Vec<u32>],
        times: &[Option<f64>],
    ) -> Vec<BlockRow<'a>> {
        steps
            .iter()
            .zip(cells)
            .zip(times)
            .map(|((&step, cells), &time)| BlockRow { step, time, cells })
            .collect()
    }

    /// Cells a run really sends, and the bit patterns that must survive untouched.
    fn random_bits(rng: &mut StdRng) -> u32 {
        match rng.gen_range(0..20) {
            0 => ABSENT_BITS,
            1 => NULL_BITS,
            2 => f32::NAN.to_bits(),
            3 => 0x7FC0_0001, // another quiet NaN payload
            4 => 0xFF80_0001, // a negative signalling NaN
            5 => (-0.0f32).to_bits(),
            6 => 0.0f32.to_bits(),
            7 => f32::INFINITY.to_bits(),
            8 => f32::from_bits(1).to_bits(), // the smallest subnormal
            9 => 1.0f32.to_bits(),
            10 => (rng.gen_range(0..1000) as f32).to_bits(),
            11 => (rng.gen_range(0..100) as f32 * 0.1).to_bits(),
            12 => rng.r#gen::<u32>(),
            _ => (rng.gen_range(-12.0f32..2.0).exp() * if rng.gen_bool(0.1) { -1.0 } else { 1.0 })
                .to_bits(),
        }
    }

    #[test]
    fn random_ragged_sparse_blocks_round_trip_exactly() {
        let mut rng = StdRng::seed_from_u64(11);
        for round in 0..60 {
            let index = rng.gen_range(0..1_000_000u64);
            let density = [1.0, 0.5, 0.1, 0.02][round % 4];
            let mut steps: Vec<u64> = (0..BLOCK_STEPS)
                .filter(|_| rng.gen_bool(density))
                .map(|i| first_step(index) + i)
                .collect();
            if steps.is_empty() {
                steps.push(first_step(index) + rng.gen_range(0..BLOCK_STEPS));
            }
            let width = rng.gen_range(1..300);
            let cells: Vec<Vec<u32>> = steps
                .iter()
                .map(|_| {
                    // Rows grow as columns are added; some stop short.
                    let len = rng.gen_range(0..=width);
                    (0..len).map(|_| random_bits(&mut rng)).collect()
                })
                .collect();
            let times: Vec<Option<f64>> = steps
                .iter()
                .map(|&s| match round % 3 {
                    0 => None,
                    1 => Some(1.7e9 + s as f64 * 0.25),
                    _ => rng.gen_bool(0.5).then(|| rng.gen_range(1.6e9..1.8e9)),
                })
                .collect();
            let families: Vec<u8> = (0..width).map(|c| (c / 40) as u8).collect();
            round_trip(index, &rows_of(&steps, &cells, &times), &families);
        }
    }

    #[test]
    fn smooth_columns_and_constants_round_trip_and_compress() {
        // What pco's float modes might pick up: decimals, integers, constants, and a
        // smooth series, with absent and null cells among them.
        let steps: Vec<u64> = (640..704).collect();
        let cells: Vec<Vec<u32>> = steps
            .iter()
            .map(|&s| {
                let t = s as f32;
                let mut row = vec![
                    (t * 0.1).to_bits(),
                    (s % 7) as f32 as u32,
                    1.0f32.to_bits(),
                    (0.01 * (1.0 + (t * 0.1).sin() * 0.05)).to_bits(),
                    if s % 5 == 0 {
                        ABSENT_BITS
                    } else {
                        2.5f32.to_bits()
                    },
                    if s % 9 == 0 {
                        NULL_BITS
                    } else {
                        (t * 1e-4).to_bits()
                    },
                ];
                row.extend(
                    (0..200).map(|m| ((m as f32 * 0.01).exp() * (1.0 + t * 1e-3)).to_bits()),
                );
                row
            })
            .collect();
        let times: Vec<Option<f64>> = steps
            .iter()
            .map(|&s| Some(1.75e9 + s as f64 * 0.5))
            .collect();
        let families: Vec<u8> = (0..206).map(|c| c.min(6) as u8).collect();
        let blob = round_trip(10, &rows_of(&steps, &cells, &times), &families);
        let values = steps.len() * 206;
        assert!(
            blob.len() < values,
            "{} bytes for {values} smooth values",
            blob.len()
        );
    }

    /// The smallest header: format, times codec, checksum, a one-byte index, the
    /// mask, a one-byte column count and segment count.
    const SMALL_HEADER: usize = 17;

    #[test]
    fn one_step_and_one_column_blocks() {
        let one = vec![vec![0.5f32.to_bits()]];
        let blob = round_trip(3, &rows_of(&[200], &one, &[None]), &[(); 0]);
        // One raw segment (codec, width, length, the cell): no pco chunk for one value.
        assert_eq!(blob.len(), SMALL_HEADER + 3 + 4);

        // Two families, both raw, merged into one segment; the time raw too.
        let few = vec![
            (0..6)
                .map(|i| (i as f32 * 1.5).to_bits())
                .collect::<Vec<u32>>(),
        ];
        let blob = round_trip(
            0,
            &rows_of(&[63], &few, &[Some(1.7e9)]),
            &[1, 1, 1, 2, 2, 2],
        );
        assert_eq!(blob.len(), SMALL_HEADER + (8 + 1 + 8) + (3 + 24));

        let column: Vec<Vec<u32>> = (0..64).map(|i| vec![(i as f32).sqrt().to_bits()]).collect();
        let steps: Vec<u64> = (0..64).collect();
        let blob = round_trip(0, &rows_of(&steps, &column, &[None; 64]), &["loss"]);
        assert!(
            blob.len() < SMALL_HEADER + 3 + 64 * 4,
            "{} bytes",
            blob.len()
        );
    }

    #[test]
    fn empty_rows_and_empty_blocks() {
        let empty: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
        round_trip(
            7,
            &rows_of(&[448, 511], &empty, &[Some(1.0), None]),
            &[0u8; 0],
        );
        let blob = round_trip(7, &[], &[0u8; 0]);
        assert_eq!(decode(&blob).unwrap().position(448), None);
    }

    #[test]
    fn the_last_block_of_the_step_range() {
        let index = block_index(u64::MAX);
        let cells = vec![vec![7], vec![8]];
        round_trip(
            index,
            &rows_of(&[first_step(index), u64::MAX], &cells, &[None, None]),
            &[0u8],
        );
    }

    #[test]
    fn times_keep_their_bits() {
        let steps: Vec<u64> = (0..64).step_by(3).collect();
        let cells: Vec<Vec<u32>> = steps.iter().map(|_| vec![1]).collect();
        for times in [
            steps
                .iter()
                .map(|&s| Some(1_732_000_000.123 + s as f64 * 0.011))
                .collect::<Vec<_>>(),
            steps
                .iter()
                .map(|&s| (s % 2 == 0).then_some(s as f64))
                .collect(),
            steps.iter().map(|_| Some(f64::NAN)).collect(),
            vec![Some(-0.0); steps.len()],
        ] {
            round_trip(0, &rows_of(&steps, &cells, &times), &[0u8]);
        }
    }

    #[test]
    fn families_change_the_size_not_the_values() {
        let steps: Vec<u64> = (0..64).collect();
        let cells: Vec<Vec<u32>> = steps
            .iter()
            .map(|&s| {
                let mut row: Vec<u32> = (0..100)
                    .map(|m| ((m as f32 * 0.05).exp() * 1e-3 * (1.0 + s as f32 * 1e-3)).to_bits())
                    .collect();
                row.extend(std::iter::repeat_n(1.0f32.to_bits(), 100));
                row.extend((0..50).map(|_| (1.0 + s as f32 * 1e-4).to_bits()));
                row
            })
            .collect();
        let rows = rows_of(&steps, &cells, &[None; 64]);
        let kinds: Vec<u8> = (0..250).map(|c| (c / 100) as u8).collect();
        let labelled = round_trip(0, &rows, &kinds);
        let unlabelled = round_trip(0, &rows, &[0u8; 0]);
        assert!(
            labelled.len() < unlabelled.len(),
            "{} vs {}",
            labelled.len(),
            unlabelled.len()
        );
    }

    #[test]
    fn rows_must_belong_to_the_block_and_ascend() {
        let cells = [1u32];
        let row = |step| BlockRow {
            step,
            time: None,
            cells: &cells,
        };
        assert!(encode(1, &[row(63)], &[0u8]).is_err());
        assert!(encode(1, &[row(128)], &[0u8]).is_err());
        assert!(encode(1, &[row(70), row(70)], &[0u8]).is_err());
        assert!(encode(1, &[row(71), row(70)], &[0u8]).is_err());
        assert!(encode(block_index(u64::MAX) + 1, &[], &[0u8]).is_err());
    }

    /// 32 steps of block 1, with times: 20 columns of anything, 20 smooth ones.
    fn sample_blob() -> Vec<u8> {
        let mut rng = StdRng::seed_from_u64(5);
        let steps: Vec<u64> = (64..128).step_by(2).collect();
        let cells: Vec<Vec<u32>> = steps
            .iter()
            .map(|&s| {
                let mut row: Vec<u32> = (0..20).map(|_| random_bits(&mut rng)).collect();
                row.extend(
                    (0..20).map(|c| (1e-3 * (c + 1) as f32 * (1.0 + s as f32 * 1e-3)).to_bits()),
                );
                row
            })
            .collect();
        let times: Vec<Option<f64>> = steps.iter().map(|&s| Some(1.7e9 + s as f64)).collect();
        let families: Vec<u8> = (0..40).map(|c| (c / 10) as u8).collect();
        let blob = encode(1, &rows_of(&steps, &cells, &times), &families).unwrap();
        // The smooth half went through pco.
        assert!(blob.len() < 32 * 30 * 4, "{} bytes", blob.len());
        blob
    }

    #[test]
    fn every_truncation_is_an_error() {
        let blob = sample_blob();
        assert!(decode(&blob).is_ok());
        for len in 0..blob.len() {
            assert!(decode(&blob[..len]).is_err(), "truncated to {len} bytes");
        }
        let mut longer = blob.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }

    #[test]
    fn every_flipped_bit_is_an_error() {
        let blob = sample_blob();
        for byte in 0..blob.len() {
            for bit in 0..8 {
                let mut corrupt = blob.clone();
                corrupt[byte] ^= 1 << bit;
                assert!(decode(&corrupt).is_err(), "bit {bit} of byte {byte}");
            }
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let mut rng = StdRng::seed_from_u64(9);
        for len in [0, 1, 5, 29, 30, 31, 100, 4096] {
            for _ in 0..50 {
                let mut garbage: Vec<u8> = (0..len).map(|_| rng.r#gen()).collect();
                if let Some(format) = garbage.first_mut() {
                    *format = FORMAT;
                }
                assert!(decode(&garbage).is_err());
                assert!(peek(&garbage).is_err());
            }
        }
    }

    /// A blob with a valid checksum that lies about its contents: never a panic, and
    /// every lie its structure shows is an error. (Not every lie shows: a perfectly
    /// regular series costs pco zero bits a value, so a wrong count decodes. The
    /// checksum is what stands between corruption and such answers.)
    #[test]
    fn inconsistent_blobs_with_valid_checksums_are_errors() {
        let blob = sample_blob();
        let reseal = |mut blob: Vec<u8>| {
            let checksum = crc32fast::hash(&blob[CHECKSUMMED_FROM..]);
            blob[2..CHECKSUMMED_FROM].copy_from_slice(&checksum.to_le_bytes());
            blob
        };
        let mut rng = StdRng::seed_from_u64(13);
        for _ in 0..2000 {
            let mut corrupt = blob.clone();
            let at = rng.gen_range(CHECKSUMMED_FROM..corrupt.len());
            corrupt[at] ^= 1 << rng.gen_range(0..8);
            // Must not panic; a flip inside a payload may still decode.
            let _ = decode(&reseal(corrupt));
        }
        // The sample's index, column count and segment count are one byte each.
        let (columns, segments) = (blob[15], blob[16]);
        assert_eq!(columns, 40);
        for (at, value) in [
            (1, 9u8),
            (15, columns - 1),
            (15, columns + 1),
            (16, segments - 1),
            (16, segments + 1),
            (16, 0x80),
        ] {
            let mut corrupt = blob.clone();
            corrupt[at] = value;
            assert!(decode(&reseal(corrupt)).is_err(), "byte {at} = {value}");
        }
        let mut other_format = blob.clone();
        other_format[0] = 2;
        assert!(decode(&other_format).is_err());
    }

    #[test]
    fn present_in_counts_the_mask_in_a_range() {
        let mask = 0b1011u64 | 1 << 63; // steps 640, 641, 643 and 703 of block 10
        let cases: [(&dyn Fn() -> u32, u32); 12] = [
            (&|| present_in(10, mask, ..), 4),
            (&|| present_in(10, mask, 640..=703), 4),
            (&|| present_in(10, mask, 0..640), 0),
            (&|| present_in(10, mask, 704..), 0),
            (&|| present_in(10, mask, 641..643), 1),
            (&|| present_in(10, mask, 641..=643), 2),
            (&|| present_in(10, mask, 703..=703), 1),
            (&|| present_in(10, mask, 0..=641), 2),
            (
                &|| present_in(10, mask, (Bound::Included(650), Bound::Excluded(600))),
                0,
            ),
            (&|| present_in(10, u64::MAX, ..), 64),
            (
                &|| present_in(10, u64::MAX, (Bound::Excluded(640), Bound::Unbounded)),
                63,
            ),
            (
                &|| {
                    present_in(
                        block_index(u64::MAX),
                        u64::MAX,
                        (Bound::Excluded(u64::MAX), Bound::Unbounded),
                    )
                },
                0,
            ),
        ];
        for (i, (count, expected)) in cases.iter().enumerate() {
            assert_eq!(count(), *expected, "case {i}");
        }
    }
}
