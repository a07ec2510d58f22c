//! Series reads. A range holding no more points than asked for is read from the step
//! blocks and returned whole; a longer one is covered by rollup buckets (blocks only
//! at its ragged ends) and reduced by the min/max downsampler.
//!
//! Every read is of one stream of the run: stream 0 holds the run's steps (for a
//! multi-rank run, its ranks combined), stream `r + 1` rank `r`'s own records.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use futures_util::TryStreamExt;
use gradflow_protocol::RunId;

use super::load::last_present;
use super::{Store, StoreError, StoreResult, with_reader};
use gradflow_core::columnar::block::{self, DecodedBlock, block_index};
use gradflow_core::columnar::codec::{ABSENT_BITS, Cell, decompressor};
use gradflow_core::columnar::columns::SeriesKind;
use gradflow_core::columnar::rollup::{CHUNK_COLUMNS, decode_columns, rollup_widths_of};
use gradflow_core::series::{Buckets, MinMax, Source, plan};

/// The stream that holds a run's steps (combined across ranks).
pub const RUN_STREAM: u32 = 0;

/// The stream of rank `rank`'s own records.
pub fn rank_stream(rank: u32) -> u32 {
    rank + 1
}

/// What to read: the first of `candidates` (kind, subject) the run has, over
/// `from..=to` of `stream`, reduced to at most `max_points` when given.
#[derive(Debug, Clone)]
pub struct SeriesRequest {
    pub candidates: Vec<(SeriesKind, String)>,
    pub from: u64,
    pub to: u64,
    pub max_points: Option<usize>,
    pub stream: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SeriesData {
    /// The candidate that was found, or `None` when the run has no such column yet.
    pub kind: Option<SeriesKind>,
    pub points: Vec<(u64, Cell)>,
    pub downsampled: bool,
}

/// How far back [`Store::latest_values`] looks for a series' latest value.
pub const LATEST_LOOKBACK: u64 = 256;

/// The latest value of each series, by (kind, subject).
#[derive(Debug, Clone, Default)]
pub struct LatestValues {
    /// The run's last stored step.
    pub step: u64,
    pub values: HashMap<(SeriesKind, String), Cell>,
}

impl LatestValues {
    pub fn get(&self, kind: SeriesKind, subject: &str) -> Option<Cell> {
        self.values.get(&(kind, subject.to_owned())).copied()
    }
}

impl Store {
    pub async fn series(&self, run_id: &RunId, request: &SeriesRequest) -> StoreResult<SeriesData> {
        let key = self.run_key(run_id).await?;
        let mut found = None;
        for (kind, subject) in &request.candidates {
            if let Some(column) = self.column_position(key, *kind, subject).await? {
                found = Some((*kind, column));
                break;
            }
        }
        let empty = SeriesData {
            kind: found.map(|(k, _)| k),
            points: Vec::new(),
            downsampled: false,
        };
        let Some((kind, column)) = found else {
            return Ok(empty);
        };
        let Some((first, last)) = self.stream_extent(key, request.stream).await? else {
            return Ok(empty);
        };
        let from = request.from.max(first);
        let to = request.to.min(last);
        if from > to {
            return Ok(empty);
        }
        let stream = request.stream;
        let Some(max_points) = self
            .reduction(key, stream, from, to, request.max_points)
            .await?
        else {
            let mut points = Vec::new();
            self.read_raw_columns(key, stream, &[column], from, to, |_, step, cell| {
                points.push((step, cell))
            })
            .await?;
            return Ok(SeriesData {
                kind: Some(kind),
                points,
                downsampled: false,
            });
        };

        let buckets = Buckets::new(from, to, max_points / 2);
        let mut minmax = MinMax::over(buckets);
        let widths = self.read_widths(key, buckets).await?;
        for source in plan(from, to, &widths) {
            let sink = |_: usize, step: u64, cell: Cell| minmax.add(step, cell);
            match source {
                Source::Raw { from, to } => {
                    self.read_raw_columns(key, stream, &[column], from, to, sink)
                        .await?
                }
                Source::Rollup { width, first, last } => {
                    self.read_rollup_columns(key, stream, &[column], width, (first, last), sink)
                        .await?
                }
            }
        }
        Ok(SeriesData {
            kind: Some(kind),
            points: minmax.finish(),
            downsampled: true,
        })
    }

    /// Every subject of `kind` over the run's steps in `buckets`, each reduced to at
    /// most two points a bucket like [`Store::series`] (whole when the range holds no
    /// more steps than that), in order of first appearance: one pass over the blocks
    /// and rollups for all of them (a chart of 200 modules decompresses each block and
    /// rollup chunk once, not once per module). A bucket with a measured step keeps at
    /// least one point of its own, so a chart drawing a column per bucket shows every
    /// measured column.
    pub async fn series_of_every_subject(
        &self,
        run_id: &RunId,
        kind: SeriesKind,
        buckets: Buckets,
    ) -> StoreResult<Vec<(String, Vec<(u64, Cell)>)>> {
        let (from, to) = (buckets.from, buckets.to);
        let key = self.run_key(run_id).await?;
        let stream = RUN_STREAM;
        let subjects: Vec<(i64, String)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT col, subject FROM columns WHERE run = $1 AND kind = $2 ORDER BY col",
            )
            .bind(key)
            .bind(kind.as_str())
            .fetch_all(pool)
            .await?
        });
        let columns: Vec<usize> = subjects.iter().map(|(c, _)| *c as usize).collect();
        let mut points: Vec<Vec<(u64, Cell)>> = vec![Vec::new(); columns.len()];
        let result = |points: Vec<Vec<(u64, Cell)>>| {
            subjects
                .iter()
                .map(|(_, subject)| subject.clone())
                .zip(points)
                .collect()
        };
        let Some((first, last)) = self.stream_extent(key, stream).await? else {
            return Ok(result(points));
        };
        let from = from.max(first);
        let to = to.min(last);
        if from > to || columns.is_empty() {
            return Ok(result(points));
        }
        if self
            .reduction(key, stream, from, to, Some(2 * buckets.count))
            .await?
            .is_none()
        {
            self.read_raw_columns(key, stream, &columns, from, to, |i, step, cell| {
                points[i].push((step, cell))
            })
            .await?;
            return Ok(result(points));
        }
        let mut reducers: Vec<MinMax> = columns.iter().map(|_| MinMax::over(buckets)).collect();
        let widths = self.read_widths(key, buckets).await?;
        for source in plan(from, to, &widths) {
            let sink = |i: usize, step: u64, cell: Cell| reducers[i].add(step, cell);
            match source {
                Source::Raw { from, to } => {
                    self.read_raw_columns(key, stream, &columns, from, to, sink)
                        .await?
                }
                Source::Rollup { width, first, last } => {
                    self.read_rollup_columns(key, stream, &columns, width, (first, last), sink)
                        .await?
                }
            }
        }
        Ok(result(reducers.into_iter().map(MinMax::finish).collect()))
    }

    /// The rollup widths a reduced read of the run into `buckets` uses, coarsest
    /// first: the run's complete levels at most half as wide as a bucket, so that
    /// every bucket holds a whole rollup bucket of each level. A rollup bucket
    /// straddling two buckets puts both its extremes in one of them; were it the
    /// other's only measure, that bucket would read as not measured (a white seam in
    /// the heatmap).
    async fn read_widths(&self, key: i64, buckets: Buckets) -> StoreResult<Vec<u64>> {
        let widest = buckets.width.div_ceil(2);
        let stored: String = with_reader!(self, |pool| {
            sqlx::query_scalar("SELECT rollup_widths FROM runs WHERE id = $1")
                .bind(key)
                .fetch_one(pool)
                .await?
        });
        Ok(rollup_widths_of(&stored)
            .into_iter()
            .rev()
            .filter(|w| *w <= widest)
            .collect())
    }

    /// The position of the run's column of `kind` for `subject`, if it has one.
    pub(super) async fn column_position(
        &self,
        key: i64,
        kind: SeriesKind,
        subject: &str,
    ) -> StoreResult<Option<usize>> {
        let column: Option<i64> = with_reader!(self, |pool| {
            sqlx::query_scalar(
                "SELECT col FROM columns WHERE run = $1 AND kind = $2 AND subject = $3",
            )
            .bind(key)
            .bind(kind.as_str())
            .bind(subject)
            .fetch_optional(pool)
            .await?
        });
        Ok(column.map(|c| c as usize))
    }

    pub(super) async fn run_key(&self, run_id: &RunId) -> StoreResult<i64> {
        self.check_ready()?;
        let key: Option<i64> = with_reader!(self, |pool| {
            sqlx::query_scalar("SELECT id FROM runs WHERE run_id = $1")
                .bind(run_id.as_str())
                .fetch_optional(pool)
                .await?
        });
        key.ok_or_else(|| StoreError::RunNotFound(run_id.as_str().to_owned()))
    }

    /// The first and last stored step of a stream, from its first and last blocks'
    /// masks; `None` while it has none.
    async fn stream_extent(&self, key: i64, stream: u32) -> StoreResult<Option<(u64, u64)>> {
        let ends: Vec<(i64, i64)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT block, mask FROM blocks WHERE run = $1 AND stream = $2 AND block IN \
                 ((SELECT min(block) FROM blocks WHERE run = $1 AND stream = $2), \
                  (SELECT max(block) FROM blocks WHERE run = $1 AND stream = $2)) \
                 ORDER BY block",
            )
            .bind(key)
            .bind(i64::from(stream))
            .fetch_all(pool)
            .await?
        });
        let (Some(&(first_block, first_mask)), Some(&(last_block, last_mask))) =
            (ends.first(), ends.last())
        else {
            return Ok(None);
        };
        let first =
            block::first_step(first_block as u64) + u64::from((first_mask as u64).trailing_zeros());
        let last = last_present(last_block as u64, last_mask as u64)
            .context("a stored block with no step")?;
        Ok(Some((first, last)))
    }

    /// `Some(max_points)` when `from..=to` of `stream` holds more stored steps than
    /// `max_points` and must be reduced; `None` when it is read whole.
    async fn reduction(
        &self,
        key: i64,
        stream: u32,
        from: u64,
        to: u64,
        max_points: Option<usize>,
    ) -> StoreResult<Option<usize>> {
        let Some(max_points) = max_points.filter(|m| to - from + 1 > *m as u64) else {
            return Ok(None);
        };
        let rows = self
            .count_stored(key, stream, from, to, max_points as u64)
            .await?;
        Ok((rows > max_points as u64).then_some(max_points))
    }

    /// How many of the run's steps in `from..=to` are stored, counted up to just past
    /// `cap`: a chart that gives each reported step its own column at most (a run
    /// reporting every 5th step gets columns 5 steps wide, not empty ones between).
    pub async fn steps_stored_in(
        &self,
        run_id: &RunId,
        from: u64,
        to: u64,
        cap: u64,
    ) -> StoreResult<u64> {
        let key = self.run_key(run_id).await?;
        self.count_stored(key, RUN_STREAM, from, to, cap).await
    }

    /// The stored steps of `stream` in `from..=to`, counted until the count passes
    /// `cap`.
    async fn count_stored(
        &self,
        key: i64,
        stream: u32,
        from: u64,
        to: u64,
        cap: u64,
    ) -> StoreResult<u64> {
        // The blocks' masks say which steps are stored, without decompressing them;
        // the count stops as soon as it passes `cap` (a long run's range would
        // otherwise read every block's mask: 15,625 of them for 10⁶ steps).
        let mut rows = 0u64;
        with_reader!(self, |pool| {
            let mut masks = sqlx::query_as::<_, (i64, i64)>(
                "SELECT block, mask FROM blocks WHERE run = $1 AND stream = $2 \
                 AND block BETWEEN $3 AND $4 ORDER BY block",
            )
            .bind(key)
            .bind(i64::from(stream))
            .bind(block_index(from) as i64)
            .bind(block_index(to) as i64)
            .fetch(pool);
            while let Some((index, mask)) = masks.try_next().await? {
                rows += u64::from(block::present_in(index as u64, mask as u64, from..=to));
                if rows > cap {
                    break;
                }
            }
        });
        Ok(rows)
    }

    /// Whether each (stream, step) of the run stored under `key` is stored: the
    /// presence masks of the blocks that hold them. Read outside any batch's
    /// transaction: a step once stored stays stored, so a committed answer is final.
    pub async fn stored_steps(&self, key: i64, wanted: &[(u32, u64)]) -> StoreResult<Vec<bool>> {
        let blocks = wanted.iter().map(|(_, step)| block::block_index(*step));
        let (Some(from), Some(to)) = (blocks.clone().min(), blocks.max()) else {
            return Ok(Vec::new());
        };
        let rows: Vec<(i64, i64, i64)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT stream, block, mask FROM blocks WHERE run = $1 AND block >= $2 \
                 AND block <= $3",
            )
            .bind(key)
            .bind(from as i64)
            .bind(to as i64)
            .fetch_all(pool)
            .await?
        });
        let masks: HashMap<(u32, u64), u64> = rows
            .into_iter()
            .map(|(stream, index, mask)| ((stream as u32, index as u64), mask as u64))
            .collect();
        Ok(wanted
            .iter()
            .map(|(stream, step)| {
                let index = block::block_index(*step);
                let bit = step - block::first_step(index);
                masks
                    .get(&(*stream, index))
                    .is_some_and(|mask| mask & (1 << bit) != 0)
            })
            .collect())
    }

    /// Each rank's last stored step of a multi-rank run, by rank (ranks that have
    /// sent nothing are absent).
    pub async fn rank_progress(&self, run_id: &RunId) -> StoreResult<Vec<(u32, u64)>> {
        let key = self.run_key(run_id).await?;
        let rows: Vec<(i64, i64, i64)> = with_reader!(self, |pool| {
            sqlx::query_as(
                "SELECT b.stream, b.block, b.mask FROM blocks b \
                 WHERE b.run = $1 AND b.stream > 0 AND b.block = \
                 (SELECT max(l.block) FROM blocks l WHERE l.run = $1 AND l.stream = b.stream) \
                 ORDER BY b.stream",
            )
            .bind(key)
            .fetch_all(pool)
            .await?
        });
        Ok(rows
            .into_iter()
            .filter_map(|(stream, index, mask)| {
                Some((stream as u32 - 1, last_present(index as u64, mask as u64)?))
            })
            .collect())
    }

    /// The subjects a run has reported for `kind`, in order of first appearance (for
    /// modules: the order the trainer reports them in, which is model order).
    pub async fn subjects(&self, run_id: &RunId, kind: SeriesKind) -> StoreResult<Vec<String>> {
        let key = self.run_key(run_id).await?;
        Ok(with_reader!(self, |pool| {
            sqlx::query_scalar(
                "SELECT subject FROM columns WHERE run = $1 AND kind = $2 ORDER BY col",
            )
            .bind(key)
            .bind(kind.as_str())
            .fetch_all(pool)
            .await?
        }))
    }

    /// The kinds of series a run has reported at least once.
    pub async fn series_kinds(&self, run_id: &RunId) -> StoreResult<HashSet<SeriesKind>> {
        let key = self.run_key(run_id).await?;
        let kinds: Vec<String> = with_reader!(self, |pool| {
            sqlx::query_scalar("SELECT DISTINCT kind FROM columns WHERE run = $1")
                .bind(key)
                .fetch_all(pool)
                .await?
        });
        Ok(kinds.iter().filter_map(|k| SeriesKind::parse(k)).collect())
    }

    /// The latest reported value of each series of `kinds`, looking back at most
    /// [`LATEST_LOOKBACK`] steps from the last one (a step may omit what an earlier
    /// one reported); `None` before the first step.
    pub async fn latest_values(
        &self,
        run_id: &RunId,
        kinds: &[SeriesKind],
    ) -> StoreResult<Option<LatestValues>> {
        let key = self.run_key(run_id).await?;
        let Some((_, last_step)) = self.stream_extent(key, RUN_STREAM).await? else {
            return Ok(None);
        };
        let columns: Vec<(i64, String, String)> = with_reader!(self, |pool| {
            sqlx::query_as("SELECT col, kind, subject FROM columns WHERE run = $1 ORDER BY col")
                .bind(key)
                .fetch_all(pool)
                .await?
        });
        let mut wanted: Vec<(usize, SeriesKind, String)> = columns
            .into_iter()
            .filter_map(|(column, kind, subject)| {
                let kind = SeriesKind::parse(&kind).filter(|k| kinds.contains(k))?;
                Some((column as usize, kind, subject))
            })
            .collect();
        let oldest = last_step.saturating_sub(LATEST_LOOKBACK - 1);
        let mut values = HashMap::new();
        with_reader!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT block, vals FROM blocks WHERE run = $1 AND stream = $2 \
                 AND block >= $3 ORDER BY block DESC",
            )
            .bind(key)
            .bind(i64::from(RUN_STREAM))
            .bind(block_index(oldest) as i64)
            .fetch(pool);
            while !wanted.is_empty()
                && let Some((index, blob)) = rows.try_next().await?
            {
                let block = decode(index, &blob)?;
                for position in (0..block.len()).rev() {
                    if block.steps()[position] < oldest {
                        break;
                    }
                    wanted.retain(|(column, kind, subject)| {
                        let cell = block.cell(position, *column);
                        if cell == Cell::Absent {
                            return true;
                        }
                        values.insert((*kind, subject.clone()), cell);
                        false
                    });
                }
            }
        });
        Ok(Some(LatestValues {
            step: last_step,
            values,
        }))
    }

    /// Calls `sink(i, step, cell)` with every present cell of `columns[i]` in steps
    /// `from..=to` of `stream`, decoding each block once for all the columns.
    async fn read_raw_columns(
        &self,
        key: i64,
        stream: u32,
        columns: &[usize],
        from: u64,
        to: u64,
        mut sink: impl FnMut(usize, u64, Cell),
    ) -> StoreResult<()> {
        with_reader!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT block, vals FROM blocks WHERE run = $1 AND stream = $2 \
                 AND block BETWEEN $3 AND $4 ORDER BY block",
            )
            .bind(key)
            .bind(i64::from(stream))
            .bind(block_index(from) as i64)
            .bind(block_index(to) as i64)
            .fetch(pool);
            while let Some((index, blob)) = rows.try_next().await? {
                let block = decode(index, &blob)?;
                for (i, column) in columns.iter().enumerate() {
                    let Some(cells) = block.column(*column) else {
                        continue;
                    };
                    for (step, bits) in block.steps().iter().zip(cells) {
                        if (from..=to).contains(step) && *bits != ABSENT_BITS {
                            sink(i, *step, Cell::from_bits(*bits));
                        }
                    }
                }
            }
        });
        Ok(())
    }

    /// Calls `sink(i, step, cell)` with the points summarising `columns[i]` in
    /// buckets `first..=last` of `stream`; every chunk a column lives in is
    /// decompressed once per bucket, whatever the number of its columns asked for.
    async fn read_rollup_columns(
        &self,
        key: i64,
        stream: u32,
        columns: &[usize],
        width: u64,
        (first, last): (u64, u64),
        mut sink: impl FnMut(usize, u64, Cell),
    ) -> StoreResult<()> {
        let mut chunks: Vec<usize> = columns.iter().map(|c| c / CHUNK_COLUMNS).collect();
        chunks.sort_unstable();
        chunks.dedup();
        let mut decompressor = decompressor()?;
        for chunk in chunks {
            let wanted: Vec<(usize, usize)> = columns
                .iter()
                .enumerate()
                .filter(|(_, c)| **c / CHUNK_COLUMNS == chunk)
                .map(|(i, c)| (i, c % CHUNK_COLUMNS))
                .collect();
            with_reader!(self, |pool| {
                let mut rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
                    "SELECT bucket, summary FROM rollups WHERE run = $1 AND stream = $2 \
                     AND width = $3 AND chunk = $4 AND bucket BETWEEN $5 AND $6 ORDER BY bucket",
                )
                .bind(key)
                .bind(i64::from(stream))
                .bind(width as i64)
                .bind(chunk as i64)
                .bind(first as i64)
                .bind(last as i64)
                .fetch(pool);
                while let Some((bucket, blob)) = rows.try_next().await? {
                    let summaries =
                        decode_columns(&blob, &mut decompressor).with_context(|| {
                            format!("decoding rollup bucket {bucket} of width {width}")
                        })?;
                    let start = bucket as u64 * width;
                    for (i, within) in &wanted {
                        if let Some(summary) = summaries.get(*within) {
                            for (offset, cell) in summary.points() {
                                sink(*i, start + offset as u64, cell);
                            }
                        }
                    }
                }
            });
        }
        Ok(())
    }
}

/// A stored block, decoded.
fn decode(index: i64, blob: &[u8]) -> StoreResult<DecodedBlock> {
    Ok(block::decode(blob).with_context(|| format!("decoding block {index}"))?)
}
