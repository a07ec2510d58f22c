//! `replica_divergence`: replicated modules whose ranks disagree, on the all-reduced
//! gradients or (v1.5) on the weights' fingerprints.

use serde_json::json;

use super::view::{
    DIVERGENCE_STEPS, DIVERGENCE_TOLERANCE, Divergence, RankView, Sampled, WEIGHTS_READINGS,
    WEIGHTS_SERIES, relative_text,
};
use crate::detect::episode::Alerts;
use crate::detect::wording::{name_list, sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::ReplicaDivergence;

/// The replicated values of `view` whose ranks disagree, worst first: the weights'
/// fingerprints (`fingerprints`), or every other series.
fn disagreeing(view: &RankView, fingerprints: bool) -> Vec<&Divergence> {
    let mut diverged: Vec<&Divergence> = view
        .divergences
        .iter()
        .filter(|d| (d.series == WEIGHTS_SERIES) == fingerprints)
        .filter(|d| d.relative() > DIVERGENCE_TOLERANCE)
        .collect();
    diverged.sort_by(|a, b| b.relative().total_cmp(&a.relative()));
    diverged
}

/// Folds one step of `subject`'s disagreement into its streak; the worst value while
/// replicas disagree, `None` (and the episode cleared) once they agree.
fn follow<'a>(
    streak: &mut Sampled,
    diverged: &[&'a Divergence],
    subject: &str,
    view: &RankView,
    alerts: &mut Alerts<'_>,
) -> Option<&'a Divergence> {
    let Some(&worst) = diverged.first() else {
        *streak = Sampled::default();
        alerts.clear(KIND, subject, view.step);
        return None;
    };
    streak.observe(true, view.step, (worst.relative(), 0.0));
    Some(worst)
}

/// Replicas' values of each step (gradients, updates, means): subject `run`. Its
/// episode ends once they have agreed for [`DIVERGENCE_STEPS`] step numbers.
pub(super) fn on_gradients(streak: &mut Sampled, view: &RankView, alerts: &mut Alerts<'_>) {
    let diverged = disagreeing(view, false);
    let Some(worst) = follow(streak, &diverged, "run", view, alerts) else {
        return;
    };
    if alerts.holds(KIND, "run") || !streak.streak.spans(DIVERGENCE_STEPS, view.step) {
        return;
    }
    let since = streak.streak.first_step(view.step);
    let names: Vec<String> = diverged
        .iter()
        .map(|d| format!("{} {}", d.subject, d.series))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    alerts.open_holding(
        Opened {
            kind: KIND,
            subject: "run".into(),
            severity: Severity::Critical,
            first_step: Some(since),
            step: Some(view.step),
            title: format!(
                "Replicas disagree: {} differs across ranks ({} apart)",
                worst.subject,
                relative_text(worst.relative())
            ),
            detail: format!(
                "On {} the ranks' values of replicated modules and parameters differ: \
                 {}. Worst: {} {} is {} on rank {} and {} on rank {}. After the gradient \
                 all-reduce every replica holds the same gradient and takes the same \
                 optimizer step, so the replicas have come apart: they now train different \
                 models.",
                step_range(since, view.step),
                name_list(&names, 6),
                worst.subject,
                worst.series,
                sci(worst.min.0),
                worst.min.1,
                sci(worst.max.0),
                worst.max.1
            ),
            fix: "Check that every rank runs backward through the DistributedDataParallel \
                  wrapper on every step (a `model.no_sync()` block left on for the whole step, \
                  or a rank that skips a step, never reduces); that buffers are synchronised \
                  (BatchNorm → SyncBatchNorm, or broadcast_buffers=True); that no module or \
                  parameter is updated outside the wrapper; and that every rank starts from \
                  the same weights and seed."
                .into(),
            evidence: json!({
                "cause": "replicas_disagree",
                "subjects": diverged.iter().take(16).map(|d| json!({
                    "subject": d.subject,
                    "series": d.series,
                    "min": d.min.0, "min_rank": d.min.1,
                    "max": d.max.0, "max_rank": d.max.1,
                    "relative": d.relative(),
                })).collect::<Vec<_>>(),
                "count": diverged.len(),
                "tolerance": DIVERGENCE_TOLERANCE,
            }),
        },
        DIVERGENCE_STEPS,
    );
}

/// Replicas' weight fingerprints, judged on the steps that carry them: subject
/// `weights`, ended by a fingerprint where they agree.
pub(super) fn on_weights(streak: &mut Sampled, view: &RankView, alerts: &mut Alerts<'_>) {
    if !view.fingerprinted {
        return;
    }
    let diverged = disagreeing(view, true);
    let Some(worst) = follow(streak, &diverged, "weights", view, alerts) else {
        return;
    };
    if alerts.holds(KIND, "weights") || streak.samples.len() < WEIGHTS_READINGS {
        return;
    }
    let since = streak.streak.first_step(view.step);
    let names: Vec<&str> = diverged.iter().map(|d| d.subject.as_str()).collect();
    alerts.open(Opened {
        kind: KIND,
        subject: "weights".into(),
        severity: Severity::Critical,
        first_step: Some(since),
        step: Some(view.step),
        title: format!(
            "Replicas' weights disagree: {} differs across ranks ({} apart)",
            worst.subject,
            relative_text(worst.relative())
        ),
        detail: format!(
            "On {} the ranks' fingerprints (sums of the weights) of replicated modules \
                 differ: {}. Worst: {}, {} on rank {} and {} on rank {}. The gradients may \
                 still agree — the all-reduce averages them whatever each replica's weights \
                 are — but the replicas have come apart and now train different models.",
            step_range(since, view.step),
            name_list(&names, 6),
            worst.subject,
            sci(worst.min.0),
            worst.min.1,
            sci(worst.max.0),
            worst.max.1
        ),
        fix: "Look for what changes weights on one rank outside the optimizer step: \
                  code that edits parameters (`.data`, `copy_`, a weight clamp or \
                  re-initialisation) only on some ranks, an optimizer or learning-rate \
                  schedule that differs between ranks, a checkpoint loaded on one rank only \
                  after the wrapper broadcast the weights. Broadcast the weights from rank \
                  0 again (or restart from a checkpoint) once the cause is fixed."
            .into(),
        evidence: json!({
            "cause": "replicas_disagree",
            "series": WEIGHTS_SERIES,
            "subjects": diverged.iter().take(16).map(|d| json!({
                "subject": d.subject,
                "min": d.min.0, "min_rank": d.min.1,
                "max": d.max.0, "max_rank": d.max.1,
                "relative": d.relative(),
            })).collect::<Vec<_>>(),
            "count": diverged.len(),
            "readings": streak.samples.len(),
            "tolerance": DIVERGENCE_TOLERANCE,
        }),
    });
}
