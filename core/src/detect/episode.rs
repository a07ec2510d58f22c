//! The streak behind most detectors' episodes: a condition seen on consecutive
//! reported steps opens an alert once it has held long enough — on so many reports
//! ([`Streak::observe`]) or over so many step numbers ([`Streak::observe_steps`], for
//! thresholds that must not depend on how often a client reports) — and the first
//! reported step without it resolves the alert. A detector whose alert opens on more
//! than a length (a second condition at the open edge, a minimum of reports beside a
//! span) says when the run is long enough itself ([`Streak::observe_when`]).
//! Detectors say what the condition is and what the alert says; this type keeps the
//! counting, so that it is written once.

use serde::{Deserialize, Serialize};

/// A condition's run of consecutive reported steps, and whether its alert is open.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Streak {
    /// The first step of the current run of the condition.
    pub since: Option<u64>,
    /// Reported steps in the current run.
    pub count: u32,
    pub open: bool,
}

/// What one observation changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    /// The condition has held on `persist` reported steps: open the alert.
    Open,
    /// The condition stopped while the alert was open: resolve it.
    Resolve,
}

impl Streak {
    /// Folds in one reported step on which the condition is `holds`; opens once it
    /// has held on `persist` reported steps running.
    pub fn observe(&mut self, holds: bool, step: u64, persist: u32) -> Option<Edge> {
        self.observe_when(holds, step, |streak| streak.count >= persist)
    }

    /// Like [`Streak::observe`], but opens once the run spans `steps` step numbers
    /// (its first step to `step`, both counted), however many of them were reported.
    pub fn observe_steps(&mut self, holds: bool, step: u64, steps: u64) -> Option<Edge> {
        self.observe_when(holds, step, |streak| {
            step + 1 - streak.first_step(step) >= steps
        })
    }

    /// The general form: folds in one reported step on which the condition is
    /// `holds`, and opens on the first step of the run on which `long_enough` (asked
    /// after the step is counted, on every step of the run until it opens) says so.
    pub fn observe_when(
        &mut self,
        holds: bool,
        step: u64,
        long_enough: impl FnOnce(&Streak) -> bool,
    ) -> Option<Edge> {
        if !holds {
            let was_open = self.open;
            *self = Streak::default();
            return was_open.then_some(Edge::Resolve);
        }
        self.since.get_or_insert(step);
        self.count += 1;
        if !self.open && long_enough(self) {
            self.open = true;
            return Some(Edge::Open);
        }
        None
    }

    /// A run known by its count of reports and its first step (read only when the
    /// count is above 0), the layout detectors stored before they counted with this
    /// type.
    pub fn from_count(count: u32, first_step: u64, open: bool) -> Streak {
        Streak {
            since: (count > 0).then_some(first_step),
            count,
            open,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_once_after_persist_steps_and_resolves_on_the_first_step_without() {
        let mut streak = Streak::default();
        let edges: Vec<Option<Edge>> = [true, true, true, true, false, false]
            .iter()
            .zip(10..)
            .map(|(holds, step)| streak.observe(*holds, step, 3))
            .collect();
        assert_eq!(
            edges,
            [
                None,
                None,
                Some(Edge::Open),
                None,
                Some(Edge::Resolve),
                None
            ]
        );
        // A run broken before it persists opens nothing.
        let mut streak = Streak::default();
        assert_eq!(streak.observe(true, 0, 3), None);
        assert_eq!(streak.observe(false, 1, 3), None);
        assert_eq!(streak.observe(true, 2, 3), None);
        assert_eq!(streak.first_step(9), 2);
    }

    #[test]
    fn by_step_numbers_a_sparse_reporter_opens_on_the_same_step() {
        // Every step reported, or every fifth: both open at step 19 for 20 steps.
        for every in [1, 5] {
            let mut streak = Streak::default();
            let opened: Vec<u64> = (0..40)
                .step_by(every)
                .filter(|&step| streak.observe_steps(true, step, 20) == Some(Edge::Open))
                .collect();
            let expected = if every == 1 { 19 } else { 20 };
            assert_eq!(opened, [expected], "every {every}");
        }
        let mut streak = Streak::default();
        assert_eq!(streak.observe_steps(true, 3, 1), Some(Edge::Open));
        assert_eq!(streak.observe_steps(false, 4, 1), Some(Edge::Resolve));
    }

    #[test]
    fn observe_when_asks_on_every_step_of_the_run_until_it_opens() {
        // Long enough from the second report on, but only once a gate is also open.
        let mut streak = Streak::default();
        let mut asked = Vec::new();
        for (step, gate) in [(0, true), (1, false), (2, false), (3, true), (4, true)] {
            let edge = streak.observe_when(true, step, |s| {
                asked.push(s.count);
                s.count >= 2 && gate
            });
            assert_eq!(edge, (step == 3).then_some(Edge::Open), "step {step}");
        }
        // Counted before it is asked; not asked once open.
        assert_eq!(asked, [1, 2, 3, 4]);
        assert_eq!(streak.observe_when(false, 5, |_| true), Some(Edge::Resolve));
        assert_eq!(streak, Streak::default());
    }

    #[test]
    fn span_counts_step_numbers_from_the_first_step_of_the_run() {
        let mut streak = Streak::default();
        assert_eq!(streak.span(7), 0);
        streak.observe(true, 10, 9);
        streak.observe(true, 15, 9);
        assert_eq!((streak.span(15), streak.span(19), streak.count), (6, 10, 2));
        assert_eq!(Streak::from_count(2, 10, false), streak);
        assert_eq!(Streak::from_count(0, 10, false), Streak::default());
    }
}
