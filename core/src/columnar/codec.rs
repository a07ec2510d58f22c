//! How one step's values are packed into a blob, and back.
//!
//! A step row holds every value of the step — each module's gradient norm and hook
//! hits, each group's norm, each reported parameter's four values, the scalars — as
//! one `f32` per column of the run's column dictionary (`columns.rs`), in column
//! order. Three states besides a number must survive, and they are NaN payloads that
//! no arithmetic produces:
//!
//! - [`Cell::Absent`]: not reported this step ("not measured");
//! - [`Cell::Null`]: reported as `null` (a module with no gradient tensor);
//! - a real NaN is always stored as the canonical quiet NaN.
//!
//! Values are stored as `f32`: seven significant digits are plenty for norms and
//! losses, and half the bytes of `f64`. Magnitudes outside `f32`'s range saturate to
//! its smallest subnormal or largest finite value rather than to 0 or infinity, so a
//! tiny non-zero gradient never reads back as exactly zero, and a finite value never
//! reads back as infinite.
//!
//! The packed floats are byte-shuffled (all first bytes, then all second bytes, …) and
//! compressed with zstd. Shuffling puts the sign/exponent bytes, which barely change
//! between neighbouring columns, next to each other, and constant columns (hook hits
//! of 1, drift of 0, a frozen mean of 1.0) collapse to almost nothing.
//!
//! Blob layout: `[format: u8 = 1][count: u32 LE][zstd(shuffled f32 LE bytes)]`. The
//! format byte lets a later encoding coexist with old rows without a migration.

use anyhow::{Context, bail};

pub use crate::model::cell::{ABSENT_BITS, Cell, NULL_BITS, to_stored_f32, widen_for_display};

const FORMAT_SHUFFLED_ZSTD: u8 = 1;
const HEADER_LEN: usize = 5;
/// zstd level 1: the faster levels already reach nearly all the gain on shuffled floats.
const ZSTD_LEVEL: i32 = 1;

/// Packs cells (as bits) into a blob.
pub fn encode(
    cells: &[u32],
    compressor: &mut zstd::bulk::Compressor<'_>,
) -> anyhow::Result<Vec<u8>> {
    let shuffled = shuffle(cells);
    let compressed = compressor
        .compress(&shuffled)
        .context("compressing a step's values")?;
    let mut blob = Vec::with_capacity(HEADER_LEN + compressed.len());
    blob.push(FORMAT_SHUFFLED_ZSTD);
    blob.extend_from_slice(&(cells.len() as u32).to_le_bytes());
    blob.extend_from_slice(&compressed);
    Ok(blob)
}

/// A new compressor at the level blobs are written with.
pub fn compressor() -> anyhow::Result<zstd::bulk::Compressor<'static>> {
    zstd::bulk::Compressor::new(ZSTD_LEVEL).context("creating a zstd compressor")
}

/// A new decompressor. Reuse it across blobs: a fresh zstd context per blob costs
/// more than decompressing a step's few hundred bytes.
pub fn decompressor() -> anyhow::Result<zstd::bulk::Decompressor<'static>> {
    zstd::bulk::Decompressor::new().context("creating a zstd decompressor")
}

/// A decoded blob: read single columns without unshuffling the rest.
pub struct Packed {
    planes: Vec<u8>,
    count: usize,
}

impl Packed {
    pub fn decode(
        blob: &[u8],
        decompressor: &mut zstd::bulk::Decompressor<'_>,
    ) -> anyhow::Result<Packed> {
        if blob.len() < HEADER_LEN {
            bail!(
                "value blob of {} bytes is shorter than its header",
                blob.len()
            );
        }
        if blob[0] != FORMAT_SHUFFLED_ZSTD {
            bail!("value blob has unknown format {}", blob[0]);
        }
        let count = u32::from_le_bytes(blob[1..5].try_into().expect("4 bytes")) as usize;
        let planes = decompressor
            .decompress(&blob[HEADER_LEN..], count * 4)
            .context("decompressing a step's values")?;
        if planes.len() != count * 4 {
            bail!(
                "value blob holds {} bytes, its header promises {}",
                planes.len(),
                count * 4
            );
        }
        Ok(Packed { planes, count })
    }

    pub fn column_count(&self) -> usize {
        self.count
    }

    /// The cell of `column`; columns past the end were added to the run's dictionary
    /// after this row was written, so they are absent from it.
    pub fn bits(&self, column: usize) -> u32 {
        if column >= self.count {
            return ABSENT_BITS;
        }
        let n = self.count;
        u32::from_le_bytes([
            self.planes[column],
            self.planes[n + column],
            self.planes[2 * n + column],
            self.planes[3 * n + column],
        ])
    }

    pub fn cell(&self, column: usize) -> Cell {
        Cell::from_bits(self.bits(column))
    }
}

fn shuffle(cells: &[u32]) -> Vec<u8> {
    let n = cells.len();
    let mut out = vec![0u8; n * 4];
    for (i, bits) in cells.iter().enumerate() {
        let bytes = bits.to_le_bytes();
        out[i] = bytes[0];
        out[n + i] = bytes[1];
        out[2 * n + i] = bytes[2];
        out[3 * n + i] = bytes[3];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips() {
        let cells = [
            Cell::Absent,
            Cell::Null,
            Cell::Value(0.0),
            Cell::Value(-0.0),
            Cell::Value(1.0),
            Cell::Value(f32::INFINITY),
            Cell::Value(f32::NEG_INFINITY),
            Cell::Value(1.2e-5),
        ];
        let bits: Vec<u32> = cells.iter().map(|c| c.to_bits()).collect();
        let blob = encode(&bits, &mut compressor().unwrap()).unwrap();
        let packed = Packed::decode(&blob, &mut decompressor().unwrap()).unwrap();
        assert_eq!(packed.column_count(), cells.len());
        for (i, cell) in cells.iter().enumerate() {
            assert_eq!(packed.cell(i).to_bits(), cell.to_bits(), "column {i}");
        }
        assert_eq!(packed.cell(cells.len()), Cell::Absent);
        let nan = Cell::from_wire(Some(f64::NAN));
        assert!(matches!(nan, Cell::Value(v) if v.is_nan()));
        assert!(matches!(Cell::from_bits(nan.to_bits()), Cell::Value(v) if v.is_nan()));
    }

    #[test]
    fn constant_columns_compress_to_almost_nothing() {
        let bits = vec![1.0f32.to_bits(); 1000];
        let blob = encode(&bits, &mut compressor().unwrap()).unwrap();
        assert!(blob.len() < 64, "{} bytes", blob.len());
    }

    #[test]
    fn corrupt_blobs_are_errors_not_panics() {
        let mut d = decompressor().unwrap();
        assert!(Packed::decode(&[], &mut d).is_err());
        assert!(Packed::decode(&[9, 0, 0, 0, 0], &mut d).is_err());
        assert!(Packed::decode(&[1, 4, 0, 0, 0, 1, 2, 3], &mut d).is_err());
    }
}
