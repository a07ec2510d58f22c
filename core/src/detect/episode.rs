//! Episodes: the one place that decides which alerts of a run are open.
//!
//! An alert is one episode of one kind on one subject. [`Episodes`] holds a run's
//! open ones and is the only owner of "is this alert open": detectors never keep a
//! flag of their own, they ask it ([`Alerts::is_open`]) and tell it what they saw.
//! It builds every [`Transition`], so an open and a resolve are written once, here.
//!
//! A detector, on each step, through [`Alerts`]:
//!
//! - counts its condition in a [`Streak`] (consecutive reports: how many, from which
//!   step) and asks [`Alerts::observe`] whether the alert opens now: the condition
//!   holds, the streak is long enough by the detector's own rule (so many reports,
//!   so many step numbers, or anything it decides), and no episode is open;
//! - or, for conditions that are not streaks (one reading opens, a verdict decided
//!   once), says [`Alerts::holds`] / [`Alerts::clear`] and [`Alerts::open`] itself.
//!
//! # When an episode ends
//!
//! A report on which the condition no longer holds ends the episode, but the resolve
//! takes effect only once the condition has stayed away for the kind's *hold*
//! ([`crate::model::alert::KindSpec::hold`], in step numbers, 20 unless the table
//! says otherwise): a report on which it holds again within the hold continues the
//! same episode, with no new alert, and doubles that episode's hold (up to
//! [`MAX_HOLD_STEPS`]), so a condition that keeps flapping is held longer each time.
//! A condition that flaps around its threshold is one episode, opened once and
//! resolved once, and its `resolved_step` is still the first step of the absence
//! that ended it. A hold of 0 or 1 resolves on the first report without it.
//!
//! `last_step` (the last step the condition held) is the step of every report while
//! the episode is open and not waiting to resolve.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::alert::{AlertKind, Opened, Transition};

/// The longest an episode's hold grows by doubling.
pub const MAX_HOLD_STEPS: u64 = 1000;

/// A condition's run of consecutive reports: how many, and from which step. Only
/// counts; whether an alert is open is [`Episodes`]' to say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Streak {
    /// The first step of the current run of the condition.
    pub since: Option<u64>,
    /// Reported steps in the current run.
    pub count: u32,
}

impl Streak {
    /// Folds in one report: counts it when the condition `holds`, else starts over.
    pub fn observe(&mut self, holds: bool, step: u64) {
        if holds {
            self.since.get_or_insert(step);
            self.count += 1;
        } else {
            *self = Streak::default();
        }
    }

    /// A run known by its count of reports and its first step (read only when the
    /// count is above 0), the layout detectors stored before they counted with this
    /// type.
    pub fn from_count(count: u32, first_step: u64) -> Streak {
        Streak {
            since: (count > 0).then_some(first_step),
            count,
        }
    }

    /// The first step of the run (`step` when none has begun).
    pub fn first_step(&self, step: u64) -> u64 {
        self.since.unwrap_or(step)
    }

    /// Step numbers the run spans at `step`, its first and `step` both counted; 0
    /// when no run has begun.
    pub fn span(&self, step: u64) -> u64 {
        self.since.map_or(0, |since| step.saturating_sub(since) + 1)
    }

    /// Whether the run has lasted `reports` reports.
    pub fn reports(&self, reports: u32) -> bool {
        self.count >= reports
    }

    /// Whether the run spans `steps` step numbers at `step`, however many of them
    /// were reported (thresholds that must not depend on how often a client reports).
    pub fn spans(&self, steps: u64, step: u64) -> bool {
        self.span(step) >= steps
    }
}

/// An open episode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Episode {
    /// The last step its condition held on (`None` until a step has been judged:
    /// a registration check).
    pub last_step: Option<u64>,
    /// While the episode waits to resolve: the first step without its condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_since: Option<u64>,
    /// Step numbers its condition must stay away before it resolves.
    #[serde(default)]
    pub hold: u64,
}

/// How long episodes wait before they resolve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Holds {
    /// Each kind's hold, as the alert table says.
    #[default]
    Table,
    /// None: the first report without the condition resolves. A detector's unit
    /// tests judge its rule alone this way.
    Immediate,
}

/// A run's open episodes by kind and subject: the one owner of "is this alert
/// open". Stored with the detectors' state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Episodes {
    open: BTreeMap<AlertKind, BTreeMap<String, Episode>>,
    #[serde(skip)]
    holds: Holds,
}

impl Episodes {
    /// No episode open; holds as `holds` says.
    pub fn new(holds: Holds) -> Episodes {
        Episodes {
            open: BTreeMap::new(),
            holds,
        }
    }

    /// The episode of `kind` on `subject`, if open.
    pub fn get(&self, kind: AlertKind, subject: &str) -> Option<&Episode> {
        self.open
            .get(&kind)
            .and_then(|subjects| subjects.get(subject))
    }

    /// Every open episode.
    pub fn iter(&self) -> impl Iterator<Item = (AlertKind, &str, &Episode)> + '_ {
        self.open.iter().flat_map(|(kind, subjects)| {
            subjects
                .iter()
                .map(move |(subject, episode)| (*kind, subject.as_str(), episode))
        })
    }

    /// Whether no episode is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Records an alert as open (one read back from the store), with the last step
    /// its condition held on.
    pub fn restore(&mut self, kind: AlertKind, subject: String, last_step: Option<u64>) {
        let hold = self.hold_of(kind);
        self.open.entry(kind).or_default().insert(
            subject,
            Episode {
                last_step,
                clear_since: None,
                hold,
            },
        );
    }

    /// A step's handle on the episodes: what the detectors judge it with.
    pub fn at(&mut self, step: u64) -> Alerts<'_> {
        Alerts {
            episodes: self,
            step,
            out: Vec::new(),
        }
    }

    /// Opens the registration's alerts (checks made before any step).
    pub fn open_all(&mut self, alerts: Vec<Opened>) -> Vec<Opened> {
        let mut handle = self.at(0);
        for alert in alerts {
            handle.open(alert);
        }
        handle
            .finish_without_step()
            .into_iter()
            .filter_map(|t| match t {
                Transition::Open(opened) => Some(opened),
                Transition::Resolve { .. } => None,
            })
            .collect()
    }

    fn hold_of(&self, kind: AlertKind) -> u64 {
        match self.holds {
            Holds::Table => kind.properties().hold,
            Holds::Immediate => 0,
        }
    }

    fn get_mut(&mut self, kind: AlertKind, subject: &str) -> Option<&mut Episode> {
        self.open
            .get_mut(&kind)
            .and_then(|subjects| subjects.get_mut(subject))
    }

    fn remove(&mut self, kind: AlertKind, subject: &str) -> Option<Episode> {
        let subjects = self.open.get_mut(&kind)?;
        let episode = subjects.remove(subject);
        if subjects.is_empty() {
            self.open.remove(&kind);
        }
        episode
    }
}

/// One step's handle on a run's [`Episodes`]: what detectors open, continue and end
/// alerts through. [`Alerts::finish`] ends the step and returns its transitions.
pub struct Alerts<'a> {
    episodes: &'a mut Episodes,
    step: u64,
    out: Vec<Transition>,
}

impl Alerts<'_> {
    /// The step being judged.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether the episode of `kind` on `subject` is open (waiting to resolve
    /// included: it has not ended yet).
    pub fn is_open(&self, kind: AlertKind, subject: &str) -> bool {
        self.episodes.get(kind, subject).is_some()
    }

    /// The subjects of `kind` with an open episode.
    pub fn open_subjects(&self, kind: AlertKind) -> impl Iterator<Item = &str> + '_ {
        self.episodes
            .open
            .get(&kind)
            .into_iter()
            .flat_map(|subjects| subjects.keys().map(String::as_str))
    }

    /// The transitions of this step so far (a detector judged after the others
    /// reads what they decided).
    pub fn transitions(&self) -> &[Transition] {
        &self.out
    }

    /// The condition of `kind` on `subject` holds on this report. An open episode
    /// goes on (one waiting to resolve stops waiting) and `true` says so; `false`:
    /// none is open, and the detector opens one when its rule says so.
    pub fn holds(&mut self, kind: AlertKind, subject: &str) -> bool {
        match self.episodes.get_mut(kind, subject) {
            Some(episode) => {
                if episode.clear_since.take().is_some() {
                    // Back within the hold: it flaps, so wait longer next time.
                    episode.hold = (episode.hold * 2).clamp(episode.hold, MAX_HOLD_STEPS);
                }
                true
            }
            None => false,
        }
    }

    /// The condition of `kind` on `subject` no longer holds, from `step` (the first
    /// step without it): its open episode resolves, now or once its hold has passed
    /// without the condition. Nothing when none is open.
    pub fn clear(&mut self, kind: AlertKind, subject: &str, step: u64) {
        let Some(episode) = self.episodes.get_mut(kind, subject) else {
            return;
        };
        let since = *episode.clear_since.get_or_insert(step);
        if self.step + 1 - since.min(self.step) >= episode.hold {
            self.resolve(kind, subject.to_owned());
        }
    }

    /// Opens `alert`'s episode. An episode of its kind and subject already open goes
    /// on instead (one waiting to resolve stops waiting): one alert per episode.
    pub fn open(&mut self, alert: Opened) {
        self.open_holding(alert, 0);
    }

    /// [`Alerts::open`], for a rule that says itself how long its condition must
    /// stay away before the episode ends: a hold of at least `steps` step numbers.
    pub fn open_holding(&mut self, alert: Opened, steps: u64) {
        if self.holds(alert.kind, &alert.subject) {
            return;
        }
        debug_assert!(
            alert.kind.properties().severities.contains(&alert.severity),
            "{} opened as {}, which the alert table does not give it",
            alert.kind,
            alert.severity
        );
        let hold = self.episodes.hold_of(alert.kind).max(steps);
        self.episodes.open.entry(alert.kind).or_default().insert(
            alert.subject.clone(),
            Episode {
                last_step: alert.step,
                clear_since: None,
                hold,
            },
        );
        self.out.push(Transition::Open(alert));
    }

    /// Folds one report of the condition of `kind` on `subject` into `streak`, and
    /// says whether its alert opens now: the condition `holds`, no episode is open,
    /// and `long_enough` (asked on every report of the run until it opens) says the
    /// streak is. A report without the condition ends the streak and [`clear`]s the
    /// episode.
    ///
    /// [`clear`]: Alerts::clear
    pub fn observe(
        &mut self,
        kind: AlertKind,
        subject: &str,
        streak: &mut Streak,
        holds: bool,
        long_enough: impl FnOnce(&Streak) -> bool,
    ) -> bool {
        streak.observe(holds, self.step);
        if !holds {
            self.clear(kind, subject, self.step);
            return false;
        }
        !self.holds(kind, subject) && long_enough(streak)
    }

    /// Ends the step: every open episode not waiting to resolve held through it,
    /// and the ones whose hold has passed resolve. The step's transitions, in the
    /// order they were decided.
    pub fn finish(mut self) -> Vec<Transition> {
        let step = self.step;
        let mut due = Vec::new();
        for (kind, subjects) in &mut self.episodes.open {
            for (subject, episode) in subjects {
                match episode.clear_since {
                    None => episode.last_step = Some(step),
                    Some(since) if step + 1 - since.min(step) >= episode.hold => {
                        due.push((*kind, subject.clone()));
                    }
                    Some(_) => {}
                }
            }
        }
        for (kind, subject) in due {
            self.resolve(kind, subject);
        }
        self.out
    }

    /// Ends a handle that judged no step (registration checks).
    fn finish_without_step(self) -> Vec<Transition> {
        self.out
    }

    fn resolve(&mut self, kind: AlertKind, subject: String) {
        let Some(episode) = self.episodes.remove(kind, &subject) else {
            return;
        };
        self.out.push(Transition::Resolve {
            kind,
            step: episode.clear_since.unwrap_or(self.step),
            last_step: episode.last_step,
            subject,
        });
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::alert::Severity;

    fn opened(step: u64) -> Opened {
        Opened {
            kind: AlertKind::LossDivergence,
            subject: "loss".into(),
            severity: Severity::Warning,
            first_step: Some(step),
            step: Some(step),
            title: String::new(),
            detail: String::new(),
            fix: String::new(),
            evidence: json!({}),
        }
    }

    /// Feeds a condition report by report (`true`: it holds) through a streak that
    /// opens on `persist` reports; (step, transition) for each transition.
    fn drive(
        episodes: &mut Episodes,
        conditions: &[(u64, bool)],
        persist: u32,
    ) -> Vec<(u64, Transition)> {
        let mut streak = Streak::default();
        let mut all = Vec::new();
        for &(step, holds) in conditions {
            let mut alerts = episodes.at(step);
            let kind = AlertKind::LossDivergence;
            if alerts.observe(kind, "loss", &mut streak, holds, |s| s.reports(persist)) {
                alerts.open(opened(streak.first_step(step)));
            }
            all.extend(alerts.finish().into_iter().map(|t| (step, t)));
        }
        all
    }

    fn steps(from: u64, holds: &[bool]) -> Vec<(u64, bool)> {
        (from..).zip(holds.iter().copied()).collect()
    }

    #[test]
    fn opens_once_after_persist_reports_and_resolves_on_the_first_report_without() {
        let mut episodes = Episodes::new(Holds::Immediate);
        let t = drive(
            &mut episodes,
            &steps(10, &[true, true, true, true, false, false]),
            3,
        );
        assert!(matches!(t[0], (12, Transition::Open(_))), "{t:?}");
        assert_eq!(
            t[1],
            (
                14,
                Transition::Resolve {
                    kind: AlertKind::LossDivergence,
                    subject: "loss".into(),
                    step: 14,
                    last_step: Some(13),
                }
            )
        );
        assert_eq!(t.len(), 2);
        assert!(episodes.is_empty());
        // A run broken before it persists opens nothing.
        assert!(drive(&mut episodes, &steps(0, &[true, false, true]), 3).is_empty());
    }

    #[test]
    fn a_condition_back_within_the_hold_is_the_same_episode() {
        let mut episodes = Episodes::default();
        let hold = AlertKind::LossDivergence.properties().hold;
        assert!(hold > 2, "loss_divergence waits before it resolves");
        // Above the bar for two reports, away for less than the hold, back: ten times.
        let mut flapping = Vec::new();
        for _ in 0..10 {
            flapping.extend([true, true]);
            flapping.extend(std::iter::repeat_n(false, hold as usize - 2));
        }
        let t = drive(&mut episodes, &steps(0, &flapping), 2);
        assert_eq!(t.len(), 1, "{t:?}");
        assert!(matches!(t[0], (1, Transition::Open(_))));
        // Each return doubled the hold. Away for the whole of it: one resolve, at
        // the first step of the absence.
        let hold_now = episodes
            .get(AlertKind::LossDivergence, "loss")
            .unwrap()
            .hold;
        assert_eq!(hold_now, (hold << 9).min(MAX_HOLD_STEPS));
        let last = flapping.len() as u64 - 1;
        let gone = vec![false; hold_now as usize];
        let t = drive(&mut episodes, &steps(last + 1, &gone), 2);
        let held = last - (hold - 2);
        assert_eq!(
            t,
            [(
                held + hold_now,
                Transition::Resolve {
                    kind: AlertKind::LossDivergence,
                    subject: "loss".into(),
                    step: held + 1,
                    last_step: Some(held),
                }
            )]
        );
    }

    #[test]
    fn each_return_within_the_hold_doubles_it() {
        let mut episodes = Episodes::default();
        let hold = AlertKind::LossDivergence.properties().hold;
        let mut alerts = episodes.at(0);
        alerts.open(opened(0));
        alerts.finish();
        let kind = AlertKind::LossDivergence;
        for (returns, step) in (1..=3).zip([10, 20, 30]) {
            let mut alerts = episodes.at(step);
            alerts.clear(kind, "loss", step);
            alerts.finish();
            let mut alerts = episodes.at(step + 1);
            assert!(alerts.holds(kind, "loss"));
            alerts.finish();
            assert_eq!(episodes.get(kind, "loss").unwrap().hold, hold << returns);
        }
        // Never past the most.
        for step in 40..60 {
            let mut alerts = episodes.at(step);
            alerts.clear(kind, "loss", step);
            alerts.holds(kind, "loss");
            alerts.finish();
        }
        assert_eq!(episodes.get(kind, "loss").unwrap().hold, MAX_HOLD_STEPS);
    }

    #[test]
    fn an_open_episode_is_not_opened_twice() {
        let mut episodes = Episodes::new(Holds::Immediate);
        let mut alerts = episodes.at(5);
        alerts.open(opened(5));
        alerts.open(opened(5));
        assert_eq!(alerts.finish().len(), 1);
        assert!(episodes.at(6).is_open(AlertKind::LossDivergence, "loss"));
        // And what nothing opened is not resolved.
        let mut alerts = episodes.at(7);
        alerts.clear(AlertKind::GradExplosion, "loss", 7);
        assert!(alerts.finish().is_empty());
    }

    #[test]
    fn by_step_numbers_a_sparse_reporter_opens_on_the_same_step() {
        // Every step reported, or every fifth: both open at step 19 for 20 steps.
        for every in [1, 5] {
            let mut streak = Streak::default();
            let mut episodes = Episodes::new(Holds::Immediate);
            let opened_at: Vec<u64> = (0..40)
                .step_by(every)
                .filter(|&step| {
                    let mut alerts = episodes.at(step);
                    let opens =
                        alerts.observe(AlertKind::LossDivergence, "loss", &mut streak, true, |s| {
                            s.spans(20, step)
                        });
                    if opens {
                        alerts.open(opened(step));
                    }
                    alerts.finish();
                    opens
                })
                .collect();
            let expected = if every == 1 { 19 } else { 20 };
            assert_eq!(opened_at, [expected], "every {every}");
        }
    }

    #[test]
    fn span_counts_step_numbers_from_the_first_step_of_the_run() {
        let mut streak = Streak::default();
        assert_eq!(streak.span(7), 0);
        streak.observe(true, 10);
        streak.observe(true, 15);
        assert_eq!((streak.span(15), streak.span(19), streak.count), (6, 10, 2));
        assert_eq!(Streak::from_count(2, 10), streak);
        assert_eq!(Streak::from_count(0, 10), Streak::default());
    }

    #[test]
    fn stored_episodes_read_back_the_same() {
        let mut episodes = Episodes::default();
        let mut alerts = episodes.at(3);
        alerts.open(opened(3));
        alerts.clear(AlertKind::LossDivergence, "loss", 4);
        alerts.finish();
        let stored = serde_json::to_string(&episodes).unwrap();
        let read: Episodes = serde_json::from_str(&stored).unwrap();
        assert_eq!(read, episodes);
    }
}
