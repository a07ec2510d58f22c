//! Reads across the rank streams of a multi-rank run at once: what the per-rank
//! view shows of every rank without one query per rank (a run may have thousands).

use anyhow::Context;
use futures_util::TryStreamExt;
use gradflow_protocol::RunId;

use super::load::last_present;
use super::read::LATEST_LOOKBACK;
use super::{Store, StoreResult, with_reader};
use gradflow_core::columnar::block::{self, BLOCK_STEPS};
use gradflow_core::columnar::codec::Cell;
use gradflow_core::columnar::columns::SeriesKind;

/// A rank's latest value of one series, from its own stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankLatest {
    pub rank: u32,
    /// The step the value is of.
    pub step: u64,
    pub cell: Cell,
}

impl Store {
    /// Each rank's latest value of `kind` of `subject` in its own stream, looking
    /// back at most [`LATEST_LOOKBACK`] steps from the rank's last stored step (a
    /// step may omit what an earlier one reported), by rank. Ranks that have sent
    /// nothing, or nothing of it in that stretch, are absent.
    pub async fn rank_latest(
        &self,
        run_id: &RunId,
        kind: SeriesKind,
        subject: &str,
    ) -> StoreResult<Vec<RankLatest>> {
        let key = self.run_key(run_id).await?;
        let Some(column) = self.column_position(key, kind, subject).await? else {
            return Ok(Vec::new());
        };
        // Every rank stream's last blocks, newest first: the last one and the few
        // before it that the look-back can reach. Each is decoded only while its
        // rank's value has not been found.
        let lookback_blocks = LATEST_LOOKBACK.div_ceil(BLOCK_STEPS) as i64;
        let mut found: Vec<RankLatest> = Vec::new();
        with_reader!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (i64, i64, i64, Vec<u8>)>(
                "SELECT b.stream, b.block, b.mask, b.vals FROM blocks b \
                 WHERE b.run = $1 AND b.stream > 0 AND b.block >= \
                 (SELECT max(l.block) FROM blocks l WHERE l.run = $1 AND l.stream = b.stream) - $2 \
                 ORDER BY b.stream, b.block DESC",
            )
            .bind(key)
            .bind(lookback_blocks)
            .fetch(pool);
            // (stream, the oldest step the look-back reaches, done)
            let mut current: Option<(i64, u64, bool)> = None;
            while let Some((stream, index, mask, blob)) = rows.try_next().await? {
                let (index, mask) = (index as u64, mask as u64);
                if current.is_none_or(|(s, _, _)| s != stream) {
                    let last = last_present(index, mask).context("a stored block with no step")?;
                    current = Some((stream, last.saturating_sub(LATEST_LOOKBACK - 1), false));
                }
                let Some((_, oldest, done)) = current.as_mut() else {
                    continue;
                };
                if *done {
                    continue;
                }
                let decoded = block::decode(&blob)
                    .with_context(|| format!("decoding block {index} of stream {stream}"))?;
                for position in (0..decoded.len()).rev() {
                    let step = decoded.steps()[position];
                    if step < *oldest {
                        *done = true;
                        break;
                    }
                    let cell = decoded.cell(position, column);
                    if cell != Cell::Absent {
                        found.push(RankLatest {
                            rank: stream as u32 - 1,
                            step,
                            cell,
                        });
                        *done = true;
                        break;
                    }
                }
            }
        });
        Ok(found)
    }
}
