//! Rollups: per bucket of steps, per column, the extremes and where they happened.
//!
//! A series read over a long range would otherwise decode one step row per step (a
//! 100,000-step run: 100,000 blobs). Rollups summarise buckets of [`ROLLUP_WIDTHS`]
//! steps, so the same read touches ~1,600 rows of the 64-step level or ~25 of the
//! 4,096-step level. A read uses only levels no wider than its output buckets, so a
//! 1,000-point read of a 10⁶-step run (2,000-step output buckets) would read 15,625
//! buckets of 64 steps; the 1,024-step level brings that to ~980. A bucket keeps, for each column, the minimum and maximum number
//! and the step offsets where they occurred, plus the first NaN and the first null:
//! exactly what the min/max downsampler needs to keep every spike and every
//! non-finite reading visible.
//!
//! A bucket is stored as chunks of [`CHUNK_COLUMNS`] columns, one row each, so a read
//! of one series decompresses only the chunk holding its column (about 1 KiB) rather
//! than the summaries of every column of the run.
//!
//! Chunk blob layout: `[format: u8 = 1][columns: u32 LE][zstd(shuffled mins, maxes
//! (f32); shuffled offsets (u16): min, max, nan, null)]`, `0xFFFF` meaning none.

use anyhow::{Context, bail};

use super::codec::{ABSENT_BITS, Cell};

/// Bucket widths of the rollup levels, finest first. Offsets within a bucket are
/// `u16`, so no level may be wider than 65,536 steps.
pub const ROLLUP_WIDTHS: [u64; 3] = [64, 1024, 4096];

/// The levels of a database written before the 1,024-step level: runs registered
/// then keep only these complete (see [`rollup_widths_of`]).
pub const FIRST_ROLLUP_WIDTHS: [u64; 2] = [64, 4096];

/// The complete rollup levels of a run, from the `rollup_widths` it was registered
/// with (a comma-separated list of widths, as stored): those of [`ROLLUP_WIDTHS`]
/// that it names. A run registered before a level existed has that level's buckets
/// only from where it went on after the upgrade, so reads must not use it.
pub fn rollup_widths_of(stored: &str) -> Vec<u64> {
    let named: Vec<u64> = stored
        .split(',')
        .filter_map(|w| w.trim().parse().ok())
        .collect();
    ROLLUP_WIDTHS
        .into_iter()
        .filter(|w| named.contains(w))
        .collect()
}
/// Columns per stored chunk of a bucket.
pub const CHUNK_COLUMNS: usize = 64;

const FORMAT: u8 = 1;
const HEADER_LEN: usize = 5;
const NONE: u16 = u16::MAX;

/// One column's summary over one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColumnSummary {
    /// Smallest number (finite or infinite), `None` if the bucket has none.
    pub min: Option<(u16, f32)>,
    /// Largest number.
    pub max: Option<(u16, f32)>,
    /// Offset of the first NaN.
    pub nan: Option<u16>,
    /// Offset of the first null (reported, not measured).
    pub null: Option<u16>,
}

impl ColumnSummary {
    pub const EMPTY: ColumnSummary = ColumnSummary {
        min: None,
        max: None,
        nan: None,
        null: None,
    };

    pub fn add(&mut self, offset: u16, cell: Cell) {
        match cell {
            Cell::Absent => {}
            Cell::Null => {
                self.null.get_or_insert(offset);
            }
            Cell::Value(v) if v.is_nan() => {
                self.nan.get_or_insert(offset);
            }
            Cell::Value(v) => {
                if self.min.is_none_or(|(_, m)| v < m) {
                    self.min = Some((offset, v));
                }
                if self.max.is_none_or(|(_, m)| v > m) {
                    self.max = Some((offset, v));
                }
            }
        }
    }

    /// The points this summary stands for, as (offset, cell).
    pub fn points(&self) -> impl Iterator<Item = (u16, Cell)> {
        let min = self.min.map(|(o, v)| (o, Cell::Value(v)));
        let max = self.max.map(|(o, v)| (o, Cell::Value(v)));
        let nan = self.nan.map(|o| (o, Cell::Value(f32::NAN)));
        let null = self.null.map(|o| (o, Cell::Null));
        [min, max, nan, null].into_iter().flatten()
    }
}

/// A bucket's summaries, one per column of the run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BucketSummary {
    pub columns: Vec<ColumnSummary>,
}

impl BucketSummary {
    /// Folds one step row in; `offset` is the step's position within the bucket.
    pub fn add_row(&mut self, offset: u16, row: &[u32]) {
        if self.columns.len() < row.len() {
            self.columns.resize(row.len(), ColumnSummary::EMPTY);
        }
        for (summary, bits) in self.columns.iter_mut().zip(row) {
            if *bits != ABSENT_BITS {
                summary.add(offset, Cell::from_bits(*bits));
            }
        }
    }

    pub fn column(&self, column: usize) -> ColumnSummary {
        self.columns
            .get(column)
            .copied()
            .unwrap_or(ColumnSummary::EMPTY)
    }

    /// How many chunks this bucket's columns fill.
    pub fn chunk_count(&self) -> usize {
        self.columns.len().div_ceil(CHUNK_COLUMNS)
    }

    /// The stored form of chunk `chunk`.
    pub fn encode_chunk(
        &self,
        chunk: usize,
        compressor: &mut zstd::bulk::Compressor<'_>,
    ) -> anyhow::Result<Vec<u8>> {
        let start = chunk * CHUNK_COLUMNS;
        let end = (start + CHUNK_COLUMNS).min(self.columns.len());
        encode_columns(&self.columns[start..end], compressor)
    }

    /// Puts a stored chunk back in place.
    pub fn restore_chunk(
        &mut self,
        chunk: usize,
        blob: &[u8],
        decompressor: &mut zstd::bulk::Decompressor<'_>,
    ) -> anyhow::Result<()> {
        let columns = decode_columns(blob, decompressor)?;
        let start = chunk * CHUNK_COLUMNS;
        if self.columns.len() < start + columns.len() {
            self.columns
                .resize(start + columns.len(), ColumnSummary::EMPTY);
        }
        self.columns[start..start + columns.len()].copy_from_slice(&columns);
        Ok(())
    }
}

fn encode_columns(
    columns: &[ColumnSummary],
    compressor: &mut zstd::bulk::Compressor<'_>,
) -> anyhow::Result<Vec<u8>> {
    let n = columns.len();
    let mut raw = vec![0u8; n * 8 + n * 8];
    let (floats, offsets) = raw.split_at_mut(n * 8);
    for (i, c) in columns.iter().enumerate() {
        let min = c
            .min
            .map_or(ABSENT_BITS, |(_, v)| v.to_bits())
            .to_le_bytes();
        let max = c
            .max
            .map_or(ABSENT_BITS, |(_, v)| v.to_bits())
            .to_le_bytes();
        for b in 0..4 {
            floats[b * 2 * n + i] = min[b];
            floats[b * 2 * n + n + i] = max[b];
        }
        let offs = [
            c.min.map_or(NONE, |(o, _)| o),
            c.max.map_or(NONE, |(o, _)| o),
            c.nan.unwrap_or(NONE),
            c.null.unwrap_or(NONE),
        ];
        for (k, off) in offs.iter().enumerate() {
            let bytes = off.to_le_bytes();
            offsets[k * n + i] = bytes[0];
            offsets[4 * n + k * n + i] = bytes[1];
        }
    }
    let compressed = compressor.compress(&raw).context("compressing a rollup")?;
    let mut blob = Vec::with_capacity(HEADER_LEN + compressed.len());
    blob.push(FORMAT);
    blob.extend_from_slice(&(n as u32).to_le_bytes());
    blob.extend_from_slice(&compressed);
    Ok(blob)
}

/// The summaries of a stored chunk.
pub fn decode_columns(
    blob: &[u8],
    decompressor: &mut zstd::bulk::Decompressor<'_>,
) -> anyhow::Result<Vec<ColumnSummary>> {
    if blob.len() < HEADER_LEN || blob[0] != FORMAT {
        bail!("rollup blob has an unknown format");
    }
    let n = u32::from_le_bytes(blob[1..5].try_into().expect("4 bytes")) as usize;
    let raw = decompressor
        .decompress(&blob[HEADER_LEN..], n * 16)
        .context("decompressing a rollup")?;
    if raw.len() != n * 16 {
        bail!("rollup blob holds {} bytes, expected {}", raw.len(), n * 16);
    }
    let (floats, offsets) = raw.split_at(n * 8);
    let float = |plane_start: usize, i: usize| {
        f32::from_bits(u32::from_le_bytes([
            floats[plane_start + i],
            floats[2 * n + plane_start + i],
            floats[4 * n + plane_start + i],
            floats[6 * n + plane_start + i],
        ]))
    };
    let offset = |k: usize, i: usize| {
        let o = u16::from_le_bytes([offsets[k * n + i], offsets[4 * n + k * n + i]]);
        (o != NONE).then_some(o)
    };
    Ok((0..n)
        .map(|i| ColumnSummary {
            min: offset(0, i).map(|o| (o, float(0, i))),
            max: offset(1, i).map(|o| (o, float(n, i))),
            nan: offset(2, i),
            null: offset(3, i),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::columnar::codec::{NULL_BITS, compressor, decompressor};

    #[test]
    fn a_summary_keeps_extremes_nan_and_null_with_their_offsets() {
        let mut bucket = BucketSummary::default();
        bucket.add_row(0, &[1.0f32.to_bits(), NULL_BITS]);
        bucket.add_row(1, &[5.0f32.to_bits(), 2.0f32.to_bits(), ABSENT_BITS]);
        bucket.add_row(2, &[f32::NAN.to_bits(), 1.0f32.to_bits(), 7.0f32.to_bits()]);
        bucket.add_row(3, &[0.5f32.to_bits()]);
        let c = bucket.column(0);
        assert_eq!(c.min, Some((3, 0.5)));
        assert_eq!(c.max, Some((1, 5.0)));
        assert_eq!(c.nan, Some(2));
        assert_eq!(c.null, None);
        let c = bucket.column(1);
        assert_eq!(c.null, Some(0));
        assert_eq!((c.min, c.max), (Some((2, 1.0)), Some((1, 2.0))));
        assert_eq!(bucket.column(2).min, Some((2, 7.0)));
        assert_eq!(bucket.column(9), ColumnSummary::EMPTY);

        let blob = bucket.encode_chunk(0, &mut compressor().unwrap()).unwrap();
        let mut back = BucketSummary::default();
        back.restore_chunk(0, &blob, &mut decompressor().unwrap())
            .unwrap();
        assert_eq!(back, bucket);
    }

    #[test]
    fn a_run_reads_the_levels_it_was_registered_with() {
        assert_eq!(rollup_widths_of("64,1024,4096"), ROLLUP_WIDTHS.to_vec());
        assert_eq!(rollup_widths_of("64,4096"), FIRST_ROLLUP_WIDTHS.to_vec());
        // A width no longer written is not read; garbage names nothing.
        assert_eq!(rollup_widths_of("64, 512,x"), vec![64]);
        assert!(ROLLUP_WIDTHS.iter().all(|w| *w <= u64::from(u16::MAX) + 1));
        assert!(ROLLUP_WIDTHS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn infinities_are_numbers_for_the_extremes() {
        let mut c = ColumnSummary::EMPTY;
        c.add(0, Cell::Value(1.0));
        c.add(1, Cell::Value(f32::INFINITY));
        c.add(2, Cell::Value(f32::NEG_INFINITY));
        assert_eq!(c.max, Some((1, f32::INFINITY)));
        assert_eq!(c.min, Some((2, f32::NEG_INFINITY)));
    }

    #[test]
    fn wide_buckets_are_stored_in_chunks() {
        let mut bucket = BucketSummary::default();
        let row: Vec<u32> = (0..150).map(|i| (i as f32).to_bits()).collect();
        bucket.add_row(7, &row);
        assert_eq!(bucket.chunk_count(), 3);
        let mut back = BucketSummary::default();
        let mut compressor = compressor().unwrap();
        for chunk in (0..3).rev() {
            let blob = bucket.encode_chunk(chunk, &mut compressor).unwrap();
            back.restore_chunk(chunk, &blob, &mut decompressor().unwrap())
                .unwrap();
        }
        assert_eq!(back, bucket);
        assert_eq!(back.column(149).max, Some((7, 149.0)));
    }

    #[test]
    fn corrupt_rollups_are_errors() {
        let mut d = decompressor().unwrap();
        assert!(decode_columns(&[2, 0, 0, 0, 0], &mut d).is_err());
        assert!(decode_columns(&[1, 9, 0, 0, 0, 0], &mut d).is_err());
    }
}
