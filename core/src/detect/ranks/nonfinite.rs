//! `rank_nonfinite`: a NaN or infinite reading on some ranks but not all, traced to
//! the rank it began on.

use std::collections::BTreeMap;

use serde_json::json;

use super::view::{RankView, clear_ranks_gone, rank_subject};
use crate::detect::episode::Alerts;
use crate::detect::wording::name_list;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::RankNonfinite;

/// What shows which ranks a step's non-finite values began on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// Some ranks' readings were non-finite and the others' finite.
    Readings,
    /// Every rank's readings were, but only some ranks' own losses.
    Loss,
    /// Every rank's readings were and every loss finite, but only some ranks' own
    /// gradients before the all-reduce (v1.7).
    LocalGrads,
}

impl Origin {
    /// The origin a step shows, if any: only a strict subset of the reporting ranks
    /// says where it began.
    fn of(view: &RankView) -> Option<Origin> {
        let some = |count: usize| count > 0 && (count as u32) < view.reported;
        let everywhere = view.nonfinite_count >= view.reported;
        if view.nonfinite_count > 0 && !everywhere {
            Some(Origin::Readings)
        } else if everywhere && some(view.loss_nonfinite.len()) {
            Some(Origin::Loss)
        } else if everywhere
            && view.loss_nonfinite.is_empty()
            && !view.scaler_skipped
            && some(view.local_grads_nonfinite.len())
        {
            // A loss scaler that skipped the step handles overflowing gradients
            // itself: one rank's overflow, spread by the all-reduce, is its business.
            Some(Origin::LocalGrads)
        } else {
            None
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Origin::Readings => "readings",
            Origin::Loss => "loss",
            Origin::LocalGrads => "local_grads",
        }
    }

    /// The ranks it began on, each with (a few of) its non-finite subjects.
    fn ranks(
        self,
        view: &RankView,
        readings: &BTreeMap<u32, &Vec<String>>,
    ) -> BTreeMap<u32, Vec<String>> {
        let from = |ranks: &[u32], fallback: &str| {
            ranks
                .iter()
                .map(|r| {
                    let subjects = readings
                        .get(r)
                        .map_or_else(|| vec![fallback.to_owned()], |s| (*s).clone());
                    (*r, subjects)
                })
                .collect()
        };
        match self {
            Origin::Readings => readings.iter().map(|(r, s)| (*r, (*s).clone())).collect(),
            Origin::Loss => from(&view.loss_nonfinite, "loss"),
            Origin::LocalGrads => from(&view.local_grads_nonfinite, "local_grads_nonfinite"),
        }
    }
}

pub(super) fn on_step(view: &RankView, alerts: &mut Alerts<'_>) {
    let readings: BTreeMap<u32, &Vec<String>> =
        view.nonfinite.iter().map(|(r, s)| (*r, s)).collect();
    // A rank whose readings are finite again.
    clear_ranks_gone(alerts, KIND, |rank| readings.contains_key(&rank));
    let Some(origin) = Origin::of(view) else {
        return;
    };
    let ranks = origin.ranks(view, &readings);
    // Where the all-reduce carried it within the step.
    let spread: Vec<u32> = if origin == Origin::Readings {
        Vec::new()
    } else {
        readings
            .keys()
            .filter(|r| !ranks.contains_key(r))
            .copied()
            .collect()
    };
    for (&rank, subjects) in &ranks {
        if alerts.holds(KIND, &rank_subject(rank)) {
            continue;
        }
        let names: Vec<&str> = subjects.iter().map(String::as_str).collect();
        let others: Vec<u32> = ranks.keys().filter(|r| **r != rank).copied().collect();
        let also = if others.is_empty() {
            String::new()
        } else {
            format!(", also ranks {others:?}")
        };
        let step = view.step;
        let (what, detail) = match origin {
            Origin::Loss => (
                "loss",
                format!(
                    "At step {step}, every reporting rank's gradients were NaN or infinite, \
                         but only {} of the {} ranks computed a non-finite loss (rank {rank}: \
                         {}){also}. The loss is each rank's own, computed before the gradient \
                         all-reduce; the all-reduce then spread rank {rank}'s non-finite \
                         gradients to the others ({spread:?}) within the same step. It began \
                         in something only rank {rank} computed: its batch.",
                    ranks.len(),
                    view.reported,
                    name_list(&names, 5),
                ),
            ),
            Origin::LocalGrads => (
                "gradients",
                format!(
                    "At step {step}, every reporting rank's gradients were NaN or infinite \
                         after the all-reduce, and every rank's loss was finite, but only {} of \
                         the {} ranks' own gradients, read as its backward pass accumulated \
                         them and before the all-reduce, held a NaN or infinity (rank \
                         {rank}){also}. The all-reduce then spread them to the others \
                         ({spread:?}) within the same step. It began in rank {rank}'s backward \
                         pass: a finite loss whose gradient is not (a sqrt, log or division at \
                         zero on its batch), or code that runs in backward on that rank alone.",
                    ranks.len(),
                    view.reported,
                ),
            ),
            Origin::Readings => (
                "values",
                format!(
                    "At step {step}, {} of the {} reporting ranks had NaN or infinite \
                         readings (rank {rank}: {}){also}; the others were finite. In \
                         data-parallel training a rank's NaN reaches every rank at the next \
                         gradient all-reduce, so this step shows where it began: something \
                         only rank {rank} computed.",
                    view.nonfinite_count,
                    view.reported,
                    name_list(&names, 5),
                ),
            ),
        };
        let fix = if origin == Origin::LocalGrads {
            format!(
                "Look at what only rank {rank}'s backward pass computed at this step: \
                     its batch (a sample whose loss is finite but whose gradient is not: \
                     sqrt, log or norm at exactly zero, a division by an empty mask's count), \
                     a custom autograd Function, or a gradient hook that runs on that rank \
                     alone. Reproduce by training on rank {rank}'s samples in one process \
                     under torch.autograd.set_detect_anomaly(True), which names the backward \
                     operation that first returned a NaN."
            )
        } else {
            format!(
                "Look at rank {rank}'s batch at this step (its shard of the dataset: a \
                     corrupt sample, an empty mask, labels out of range) and at code that \
                     runs on that rank alone after backward (a hook, a rank-dependent branch). \
                     Reproduce by training on rank {rank}'s samples in one process under \
                     torch.autograd.set_detect_anomaly(True)."
            )
        };
        alerts.open(Opened {
            kind: KIND,
            subject: rank_subject(rank),
            severity: Severity::Critical,
            first_step: Some(step),
            step: Some(step),
            title: format!("Non-finite {what} on rank {rank} only, at step {step}"),
            detail,
            fix,
            evidence: json!({
                "cause": "rank_local",
                "rank": rank,
                "ranks": ranks.keys().collect::<Vec<_>>(),
                "ranks_reported": view.reported,
                "subjects": subjects,
                "origin": origin.as_str(),
                "spread_to": spread,
            }),
        });
    }
}
