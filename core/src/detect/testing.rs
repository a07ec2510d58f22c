//! What the detectors' unit tests share: records fed in order through a run's
//! episodes that resolve at once, so each test judges its detector's rule alone.

#![cfg(test)]

use std::borrow::Borrow;

use gradflow_protocol::StepRecord;

use super::context::RunContext;
use super::episode::{Alerts, Episodes, Holds};
use super::thresholds::Thresholds;
use super::view::StepView;
use crate::model::alert::{AlertKind, Transition};

/// Feeds `records` in order to `on_step` and collects every transition, with the
/// step of the record that caused it.
pub fn transitions<R: Borrow<StepRecord>>(
    records: impl IntoIterator<Item = R>,
    on_step: impl FnMut(&StepRecord, &mut Alerts<'_>),
) -> Vec<(u64, Transition)> {
    transitions_from(&mut Episodes::new(Holds::Immediate), records, on_step)
}

/// [`transitions`] from episodes already open (as a restarted server reads them).
pub fn transitions_from<R: Borrow<StepRecord>>(
    episodes: &mut Episodes,
    records: impl IntoIterator<Item = R>,
    mut on_step: impl FnMut(&StepRecord, &mut Alerts<'_>),
) -> Vec<(u64, Transition)> {
    let mut all = Vec::new();
    for record in records {
        let record = record.borrow();
        let mut alerts = episodes.at(record.step);
        on_step(record, &mut alerts);
        all.extend(alerts.finish().into_iter().map(|t| (record.step, t)));
    }
    all
}

/// [`transitions`] for a detector that needs nothing of the registration: each
/// record seen through a [`StepView`] of an empty one.
pub fn viewed<R: Borrow<StepRecord>>(
    records: impl IntoIterator<Item = R>,
    mut on_step: impl FnMut(&StepView<'_>, &mut Alerts<'_>),
) -> Vec<(u64, Transition)> {
    let context = empty_context();
    transitions(records, |record, alerts| {
        on_step(&StepView::new(&context, record), alerts)
    })
}

/// The context of a run that registered no parameter.
pub fn empty_context() -> RunContext {
    let registration =
        serde_json::from_value(serde_json::json!({"params": []})).expect("an empty registration");
    RunContext::new(&registration, Thresholds::default())
}

/// A step record from its JSON.
pub fn record(value: serde_json::Value) -> StepRecord {
    serde_json::from_value(value).expect("a valid step record")
}

/// A run's episodes, for a test that hands a detector its records one at a time.
pub struct Run(Episodes);

impl Default for Run {
    fn default() -> Self {
        Run(Episodes::new(Holds::Immediate))
    }
}

impl Run {
    /// One step of the run: what `on_step` decided on it.
    pub fn step(&mut self, step: u64, on_step: impl FnOnce(&mut Alerts<'_>)) -> Vec<Transition> {
        let mut alerts = self.0.at(step);
        on_step(&mut alerts);
        alerts.finish()
    }
}

/// What a registration (JSON, validated) opens on its own: its wiring findings' and
/// its checks' alerts.
pub fn registration_alerts(value: serde_json::Value) -> Vec<crate::model::alert::Opened> {
    let registration: gradflow_protocol::RunRegistration =
        serde_json::from_value(value).expect("a registration");
    registration.validate().expect("a valid registration");
    super::registration::check(&RunContext::new(&registration, Thresholds::default()))
}

/// The kinds of the alerts that opened, in order.
pub fn opened_kinds(transitions: &[(u64, Transition)]) -> Vec<AlertKind> {
    transitions
        .iter()
        .filter_map(|(_, t)| match t {
            Transition::Open(o) => Some(o.kind),
            _ => None,
        })
        .collect()
}
