//! `shard_reported_as_global`: ranks that each report a part of a module registered
//! `replicated`, the parts adding up to the whole.

use std::collections::BTreeMap;

use serde_json::json;

use super::view::{RankView, ShardSuspect};
use crate::detect::episode::Alerts;
use crate::detect::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::ShardReportedAsGlobal;

pub(super) fn on_step(view: &RankView, alerts: &mut Alerts<'_>) {
    let mut by_group: BTreeMap<&str, Vec<&ShardSuspect>> = BTreeMap::new();
    for suspect in &view.shard_suspects {
        by_group.entry(&suspect.group).or_default().push(suspect);
    }
    let healed: Vec<String> = alerts
        .open_subjects(KIND)
        .filter(|group| !by_group.contains_key(group))
        .map(str::to_owned)
        .collect();
    for group in healed {
        alerts.clear(KIND, &group, view.step);
    }
    for (group, suspects) in by_group {
        if alerts.holds(KIND, group) {
            continue;
        }
        let first = suspects[0];
        let modules: Vec<&str> = suspects.iter().map(|s| s.module.as_str()).collect();
        alerts.open(Opened {
            kind: KIND,
            subject: group.to_owned(),
            severity: Severity::Critical,
            first_step: Some(view.step),
            step: Some(view.step),
            title: format!(
                "{group}: each rank reports a shard of its parameters as if it were the whole"
            ),
            detail: format!(
                "Modules of {group} ({}) are registered as replicated, but at step {} \
                     each of {} ranks reported only part of their elements: {} has {} \
                     elements as registered, the ranks reported at most {} each and {} \
                     together. The client read each rank's local shard of a sharded tensor \
                     as the whole tensor, so the norms shown for these modules are one \
                     shard's (off by about √{} when the shards are even), and a rank whose \
                     shard is empty reports a false zero.",
                name_list(&modules, 5),
                view.step,
                first.ranks,
                first.module,
                first.registered,
                first.largest,
                first.sum,
                first.ranks
            ),
            fix: "Register these parameters with \"layout\": \"sharded\" (an amendment \
                      in a step record does it while the run trains), so the server adds the \
                      ranks' sums of squares; the gradflow Python client does this for \
                      DTensor parameters under FSDP2. A client that computes norms itself \
                      must reduce the shards' sums of squares (or call full_tensor()) \
                      before taking the square root."
                .into(),
            evidence: json!({
                "cause": "local_shard_as_global",
                "modules": suspects.iter().take(16).map(|s| json!({
                    "module": s.module,
                    "registered_numel": s.registered,
                    "largest_rank_numel": s.largest,
                    "sum_of_rank_numel": s.sum,
                    "ranks": s.ranks,
                })).collect::<Vec<_>>(),
                "count": suspects.len(),
            }),
        });
    }
}
