//! `rank_missing`: a step completed without a rank's record, and whether the rank
//! closed or went silent.

use std::collections::BTreeMap;

use serde_json::json;

use super::view::{RankView, clear_ranks_gone, rank_subject};
use crate::detect::episode::Alerts;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::RankMissing;

pub(super) fn on_step(view: &RankView, alerts: &mut Alerts<'_>) {
    let missing: BTreeMap<u32, Option<u64>> = view.missing.iter().copied().collect();
    // Ranks back in the combined step.
    clear_ranks_gone(alerts, KIND, |rank| missing.contains_key(&rank));
    for (&rank, &last) in &missing {
        if alerts.holds(KIND, &rank_subject(rank)) {
            continue;
        }
        let last_text = match last {
            Some(last) => format!("its last record was of step {last}"),
            None => "it has sent no record at all".to_owned(),
        };
        let closed = view.closed.contains(&rank);
        let why = if closed {
            format!(
                "rank {rank} closed (its client finished) without having sent it, so the step was completed at once"
            )
        } else {
            "the other ranks moved on and the server could not wait longer".to_owned()
        };
        alerts.open(Opened {
            kind: KIND,
            subject: rank_subject(rank),
            severity: Severity::Critical,
            first_step: Some(view.step),
            step: Some(view.step),
            title: format!(
                "Rank {rank} of {} stopped reporting: step {} completed without it",
                view.world_size, view.step
            ),
            detail: format!(
                "Step {} of this {}-rank run was completed from {} ranks' records without \
                     rank {rank}'s: {why}; {last_text}. {}Until it is back the run's norms \
                     of sharded parameters lack its shards.",
                view.step,
                view.world_size,
                view.reported,
                if closed {
                    "Its training loop stopped calling gf.step (a branch only that rank \
                         takes, an exception caught around it, a loop that ends early on that \
                         rank) while the job went on. "
                } else {
                    "Its process may have died (out of memory, a collective timeout), \
                         hung, or lost its way to the server (then its records arrive later \
                         from its spool). "
                }
            ),
            fix: format!(
                "Look at rank {rank}'s process and log first (OOM killer, NCCL/gloo \
                     timeout, an exception only it raised). If it is alive and training, check \
                     that it can reach the gradflow server. Under torchrun an elastic restart \
                     (--max-restarts) brings a lost rank back."
            ),
            evidence: json!({
                "cause": "stopped_reporting",
                "rank": rank,
                "world_size": view.world_size,
                "ranks_reported": view.reported,
                "last_step": last,
                "closed": closed,
            }),
        });
    }
}
