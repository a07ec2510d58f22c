//! `rank_nonfinite`: a NaN or infinite reading on some ranks but not all, traced to
//! the rank it began on.

use std::collections::BTreeMap;

use serde_json::json;

use super::super::{AlertKind, Opened, Severity, Transition, name_list};
use super::*;

impl RankDetectors {
    pub(super) fn on_nonfinite(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        let ranks: BTreeMap<u32, &Vec<String>> =
            view.nonfinite.iter().map(|(r, s)| (*r, s)).collect();
        // A rank whose readings are finite again.
        resolve_ranks_gone(
            &mut self.nonfinite,
            |rank| ranks.contains_key(rank),
            AlertKind::RankNonfinite,
            view.step,
            out,
        );
        // Only a strict subset of the reporting ranks says where it began: of those
        // with any non-finite reading, or else of those whose own loss was not finite
        // (a NaN in one rank's batch reaches every rank's gradients in the same step).
        let loss_count = view.loss_nonfinite.len() as u32;
        let by_loss =
            view.nonfinite_count >= view.reported && loss_count > 0 && loss_count < view.reported;
        let subset = view.nonfinite_count > 0 && view.nonfinite_count < view.reported;
        if !subset && !by_loss {
            return;
        }
        let origin: BTreeMap<u32, Vec<String>> = if by_loss {
            view.loss_nonfinite
                .iter()
                .map(|r| {
                    let subjects = ranks
                        .get(r)
                        .map_or_else(|| vec!["loss".to_owned()], |s| (*s).clone());
                    (*r, subjects)
                })
                .collect()
        } else {
            ranks.iter().map(|(r, s)| (*r, (*s).clone())).collect()
        };
        let spread: Vec<u32> = if by_loss {
            ranks
                .keys()
                .filter(|r| !origin.contains_key(r))
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        let ranks = origin;
        for (&rank, subjects) in &ranks {
            if self.nonfinite.contains_key(&rank) {
                continue;
            }
            self.nonfinite.insert(rank, view.step);
            let names: Vec<&str> = subjects.iter().map(String::as_str).collect();
            let others: Vec<u32> = ranks.keys().filter(|r| **r != rank).copied().collect();
            out.push(Transition::Open(Opened {
                kind: AlertKind::RankNonfinite,
                subject: rank_subject(rank),
                severity: Severity::Critical,
                first_step: Some(view.step),
                step: Some(view.step),
                title: format!(
                    "Non-finite {} on rank {rank} only, at step {}",
                    if by_loss { "loss" } else { "values" },
                    view.step
                ),
                detail: if by_loss {
                    format!(
                        "At step {}, every reporting rank's gradients were NaN or infinite, \
                         but only {} of the {} ranks computed a non-finite loss (rank {rank}: \
                         {}){}. The loss is each rank's own, computed before the gradient \
                         all-reduce; the all-reduce then spread rank {rank}'s non-finite \
                         gradients to the others ({spread:?}) within the same step. It began \
                         in something only rank {rank} computed: its batch.",
                        view.step,
                        ranks.len(),
                        view.reported,
                        name_list(&names, 5),
                        if others.is_empty() {
                            String::new()
                        } else {
                            format!(", also ranks {others:?}")
                        }
                    )
                } else {
                    format!(
                        "At step {}, {} of the {} reporting ranks had NaN or infinite readings \
                         (rank {rank}: {}){}; the others were finite. In data-parallel \
                         training a rank's NaN reaches every rank at the next gradient \
                         all-reduce, so this step shows where it began: something only rank \
                         {rank} computed.",
                        view.step,
                        view.nonfinite_count,
                        view.reported,
                        name_list(&names, 5),
                        if others.is_empty() {
                            String::new()
                        } else {
                            format!(", also ranks {others:?}")
                        }
                    )
                },
                fix: format!(
                    "Look at rank {rank}'s batch at this step (its shard of the dataset: a \
                     corrupt sample, an empty mask, labels out of range) and at code that \
                     runs on that rank alone after backward (a hook, a rank-dependent branch). \
                     Reproduce by training on rank {rank}'s samples in one process under \
                     torch.autograd.set_detect_anomaly(True)."
                ),
                evidence: json!({
                    "cause": "rank_local",
                    "rank": rank,
                    "ranks": ranks.keys().collect::<Vec<_>>(),
                    "ranks_reported": view.reported,
                    "subjects": subjects,
                    "origin": if by_loss { "loss" } else { "readings" },
                    "spread_to": spread,
                }),
            }));
        }
    }
}
