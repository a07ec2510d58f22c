//! Series reads. A range holding no more points than asked for is read from the step
//! rows and returned whole; a longer one is covered by rollup buckets (raw rows only
//! at its ragged ends) and reduced by the min/max downsampler.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use futures_util::TryStreamExt;
use gradflow_protocol::RunId;

use super::codec::{Cell, Packed, decompressor};
use super::columns::SeriesKind;
use super::rollup::{CHUNK_COLUMNS, ROLLUP_WIDTHS, decode_columns};
use super::{Store, StoreError, StoreResult, with_reader};
use crate::series::{MinMax, Source, plan};

/// What to read: the first of `candidates` (kind, subject) the run has, over
/// `from..=to`, reduced to at most `max_points` when given.
#[derive(Debug, Clone)]
pub struct SeriesRequest {
    pub candidates: Vec<(SeriesKind, String)>,
    pub from: u64,
    pub to: u64,
    pub max_points: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SeriesData {
    /// The candidate that was found, or `None` when the run has no such column yet.
    pub kind: Option<SeriesKind>,
    pub points: Vec<(u64, Cell)>,
    pub downsampled: bool,
}

/// How far back [`Store::latest_values`] looks for a series' latest value.
pub const LATEST_LOOKBACK: i64 = 256;

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
        let (key, first, last) = self.run_extent(run_id).await?;
        let mut found = None;
        for (kind, subject) in &request.candidates {
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
            if let Some(column) = column {
                found = Some((*kind, column as usize));
                break;
            }
        }
        let empty = SeriesData {
            kind: found.map(|(k, _)| k),
            points: Vec::new(),
            downsampled: false,
        };
        let (Some((kind, column)), Some(first), Some(last)) = (found, first, last) else {
            return Ok(empty);
        };
        let from = request.from.max(first as u64);
        let to = request.to.min(last as u64);
        if from > to {
            return Ok(empty);
        }
        let Some(max_points) = self.reduction(key, from, to, request.max_points).await? else {
            let mut points = Vec::new();
            self.read_raw(key, column, from, to, |step, cell| {
                points.push((step, cell))
            })
            .await?;
            return Ok(SeriesData {
                kind: Some(kind),
                points,
                downsampled: false,
            });
        };

        let mut minmax = MinMax::new(from, to, max_points);
        let widths: Vec<u64> = ROLLUP_WIDTHS
            .iter()
            .rev()
            .copied()
            .filter(|w| *w <= minmax.bucket_width())
            .collect();
        for source in plan(from, to, &widths) {
            match source {
                Source::Raw { from, to } => {
                    self.read_raw(key, column, from, to, |step, cell| minmax.add(step, cell))
                        .await?;
                }
                Source::Rollup { width, first, last } => {
                    self.read_rollups(key, column, width, (first, last), |step, cell| {
                        minmax.add(step, cell)
                    })
                    .await?;
                }
            }
        }
        Ok(SeriesData {
            kind: Some(kind),
            points: minmax.finish(),
            downsampled: true,
        })
    }

    /// Every subject of `kind` over `from..=to`, each reduced to at most `max_points`
    /// like [`Store::series`], in order of first appearance: one pass over the rows and
    /// rollups for all of them (a chart of 200 modules decompresses each rollup chunk
    /// once, not once per module).
    pub async fn series_of_every_subject(
        &self,
        run_id: &RunId,
        kind: SeriesKind,
        from: u64,
        to: u64,
        max_points: usize,
    ) -> StoreResult<Vec<(String, Vec<(u64, Cell)>)>> {
        let (key, first, last) = self.run_extent(run_id).await?;
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
        let (Some(first), Some(last)) = (first, last) else {
            return Ok(result(points));
        };
        let from = from.max(first as u64);
        let to = to.min(last as u64);
        if from > to || columns.is_empty() {
            return Ok(result(points));
        }
        let Some(max_points) = self.reduction(key, from, to, Some(max_points)).await? else {
            self.read_raw_columns(key, &columns, from, to, |i, step, cell| {
                points[i].push((step, cell))
            })
            .await?;
            return Ok(result(points));
        };
        let mut reducers: Vec<MinMax> = columns
            .iter()
            .map(|_| MinMax::new(from, to, max_points))
            .collect();
        let widths: Vec<u64> = ROLLUP_WIDTHS
            .iter()
            .rev()
            .copied()
            .filter(|w| *w <= reducers[0].bucket_width())
            .collect();
        for source in plan(from, to, &widths) {
            let sink = |i: usize, step: u64, cell: Cell| reducers[i].add(step, cell);
            match source {
                Source::Raw { from, to } => {
                    self.read_raw_columns(key, &columns, from, to, sink).await?
                }
                Source::Rollup { width, first, last } => {
                    self.read_rollup_columns(key, &columns, width, (first, last), sink)
                        .await?
                }
            }
        }
        Ok(result(reducers.into_iter().map(MinMax::finish).collect()))
    }

    /// The run's key and its first and last stored steps.
    async fn run_extent(&self, run_id: &RunId) -> StoreResult<(i64, Option<i64>, Option<i64>)> {
        self.check_ready()?;
        let run = with_reader!(self, |pool| {
            sqlx::query_as("SELECT id, first_step, last_step FROM runs WHERE run_id = $1")
                .bind(run_id.as_str())
                .fetch_optional(pool)
                .await?
        });
        run.ok_or_else(|| StoreError::RunNotFound(run_id.as_str().to_owned()))
    }

    /// `Some(max_points)` when `from..=to` holds more stored steps than `max_points`
    /// and must be reduced; `None` when it is read whole.
    async fn reduction(
        &self,
        key: i64,
        from: u64,
        to: u64,
        max_points: Option<usize>,
    ) -> StoreResult<Option<usize>> {
        let Some(max_points) = max_points.filter(|m| to - from + 1 > *m as u64) else {
            return Ok(None);
        };
        let rows: i64 = with_reader!(self, |pool| {
            sqlx::query_scalar(
                "SELECT count(*) FROM steps WHERE run = $1 AND step BETWEEN $2 AND $3",
            )
            .bind(key)
            .bind(from as i64)
            .bind(to as i64)
            .fetch_one(pool)
            .await?
        });
        Ok((rows as u64 > max_points as u64).then_some(max_points))
    }

    /// The subjects a run has reported for `kind`, in order of first appearance (for
    /// modules: the order the trainer reports them in, which is model order).
    pub async fn subjects(&self, run_id: &RunId, kind: SeriesKind) -> StoreResult<Vec<String>> {
        let (key, _, _) = self.run_extent(run_id).await?;
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
        let (key, _, _) = self.run_extent(run_id).await?;
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
        let (key, _, last_step) = self.run_extent(run_id).await?;
        let Some(last_step) = last_step else {
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
        let mut decompressor = decompressor()?;
        let mut values = HashMap::new();
        with_reader!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT step, vals FROM steps WHERE run = $1 ORDER BY step DESC LIMIT $2",
            )
            .bind(key)
            .bind(LATEST_LOOKBACK)
            .fetch(pool);
            while !wanted.is_empty()
                && let Some((step, blob)) = rows.try_next().await?
            {
                let packed = Packed::decode(&blob, &mut decompressor)
                    .with_context(|| format!("decoding the values of step {step}"))?;
                wanted.retain(|(column, kind, subject)| {
                    let cell = packed.cell(*column);
                    if cell == Cell::Absent {
                        return true;
                    }
                    values.insert((*kind, subject.clone()), cell);
                    false
                });
            }
        });
        Ok(Some(LatestValues {
            step: last_step as u64,
            values,
        }))
    }

    /// Calls `sink` with every present cell of `column` in steps `from..=to`.
    async fn read_raw(
        &self,
        key: i64,
        column: usize,
        from: u64,
        to: u64,
        mut sink: impl FnMut(u64, Cell),
    ) -> StoreResult<()> {
        self.read_raw_columns(key, &[column], from, to, |_, step, cell| sink(step, cell))
            .await
    }

    /// Calls `sink(i, step, cell)` with every present cell of `columns[i]` in steps
    /// `from..=to`, decoding each row once for all the columns.
    async fn read_raw_columns(
        &self,
        key: i64,
        columns: &[usize],
        from: u64,
        to: u64,
        mut sink: impl FnMut(usize, u64, Cell),
    ) -> StoreResult<()> {
        let mut decompressor = decompressor()?;
        with_reader!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT step, vals FROM steps WHERE run = $1 AND step BETWEEN $2 AND $3 \
                 ORDER BY step",
            )
            .bind(key)
            .bind(from as i64)
            .bind(to as i64)
            .fetch(pool);
            while let Some((step, blob)) = rows.try_next().await? {
                let packed = Packed::decode(&blob, &mut decompressor)
                    .with_context(|| format!("decoding the values of step {step}"))?;
                for (i, column) in columns.iter().enumerate() {
                    let cell = packed.cell(*column);
                    if cell != Cell::Absent {
                        sink(i, step as u64, cell);
                    }
                }
            }
        });
        Ok(())
    }

    /// Calls `sink` with the points summarising `column` in buckets `first..=last`.
    async fn read_rollups(
        &self,
        key: i64,
        column: usize,
        width: u64,
        buckets: (u64, u64),
        mut sink: impl FnMut(u64, Cell),
    ) -> StoreResult<()> {
        self.read_rollup_columns(key, &[column], width, buckets, |_, step, cell| {
            sink(step, cell)
        })
        .await
    }

    /// Calls `sink(i, step, cell)` with the points summarising `columns[i]` in
    /// buckets `first..=last`; every chunk a column lives in is decompressed once
    /// per bucket, whatever the number of its columns asked for.
    async fn read_rollup_columns(
        &self,
        key: i64,
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
                    "SELECT bucket, summary FROM rollups WHERE run = $1 AND width = $2 \
                     AND chunk = $3 AND bucket BETWEEN $4 AND $5 ORDER BY bucket",
                )
                .bind(key)
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
