//! `rank_straggler`: a rank whose own work on each step takes the others' median
//! many times over.

use serde_json::json;

use std::collections::BTreeMap;

use super::view::{
    RankView, STRAGGLER_MIN_EXCESS, STRAGGLER_RATIO, STRAGGLER_STEPS, Sampled, rank_subject,
};
use crate::detect::episode::Alerts;
use crate::detect::wording::step_range;
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::RankStraggler;

/// Each rank's run of slow steps.
pub(super) fn on_step(
    stragglers: &mut BTreeMap<u32, Sampled>,
    view: &RankView,
    alerts: &mut Alerts<'_>,
) {
    if view.step_times.len() < 2 {
        return;
    }
    for &(rank, time) in &view.step_times {
        let mut others: Vec<f64> = view
            .step_times
            .iter()
            .filter(|(r, t)| *r != rank && t.is_finite())
            .map(|(_, t)| *t)
            .collect();
        if others.is_empty() || !time.is_finite() {
            continue;
        }
        others.sort_by(f64::total_cmp);
        let median = others[others.len() / 2];
        let slow = time >= STRAGGLER_RATIO * median && time - median >= STRAGGLER_MIN_EXCESS;
        let run = stragglers.entry(rank).or_default();
        straggler_step(run, rank, view, slow, time, median, alerts);
    }
    stragglers.retain(|_, run| run.streak.since.is_some());
}

/// One straggler-streak step of `rank`. Its episode ends once the rank has not been
/// slow for [`STRAGGLER_STEPS`] step numbers.
fn straggler_step(
    run: &mut Sampled,
    rank: u32,
    view: &RankView,
    slow: bool,
    time: f64,
    median: f64,
    alerts: &mut Alerts<'_>,
) {
    let subject = rank_subject(rank);
    run.observe(slow, view.step, (time, median));
    if !slow {
        alerts.clear(KIND, &subject, view.step);
        return;
    }
    if alerts.holds(KIND, &subject) || !run.streak.spans(STRAGGLER_STEPS, view.step) {
        return;
    }
    let since = run.streak.first_step(view.step);
    let streak = run;
    let median_of = |pick: fn(&(f64, f64)) -> f64| {
        let mut values: Vec<f64> = streak.samples.iter().map(pick).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let own = median_of(|s| s.0);
    let others = median_of(|s| s.1);
    alerts.open_holding(
        Opened {
            kind: KIND,
            subject: rank_subject(rank),
            severity: Severity::Warning,
            first_step: Some(since),
            step: Some(view.step),
            title: format!(
                "Rank {rank} is a straggler: {:.0} ms a step against {:.0} ms on the other ranks",
                own * 1e3,
                others * 1e3
            ),
            detail: format!(
                "Over {} rank {rank} spent a median {:.1} ms of its own work on each step, {:.1}× \
             the other ranks' {:.1} ms. In lockstep data parallelism every rank waits for it \
             at each gradient all-reduce, so the whole run goes at its pace: about {:.0} % of \
             each step is the others waiting.",
                step_range(since, view.step),
                own * 1e3,
                own / others,
                others * 1e3,
                (1.0 - others / own) * 100.0
            ),
            fix: format!(
                "Find what only rank {rank} does more of: its data loader (fewer workers, a slower \
             disk or a longer shard of variable-length samples), a slower or throttled device \
             (check its temperature and clocks), another process on its GPU or CPU, or extra \
             work on that rank (logging, checkpointing, evaluation on rank {rank} only)."
            ),
            evidence: json!({
                "cause": "slow_rank",
                "rank": rank,
                "step_time_ms": own * 1e3,
                "others_median_ms": others * 1e3,
                "ratio": own / others,
                "steps": view.step + 1 - since,
            }),
        },
        STRAGGLER_STEPS,
    );
}
