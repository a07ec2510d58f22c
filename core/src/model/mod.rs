//! The vocabulary every layer shares, with no behaviour of its own: what an alert
//! is, what a stored value is, and the kinds of series. It imports nothing of the
//! server, so the detectors, the store and the HTTP layers can all name these
//! without importing one another.
//!
//! # Layout
//!
//! - [`alert`]: [`alert::AlertKind`], [`alert::Severity`], [`alert::Opened`] and a
//!   detector's [`alert::Transition`].
//! - [`cell`]: [`cell::Cell`], one stored value, and how wire numbers become `f32`s.
//! - [`series_kind`]: [`series_kind::SeriesKind`], what a column holds.
//! - [`metric`]: [`metric::METRICS`], the metric names read by name (the series
//!   API, the comparison, the per-rank charts) and the series kinds behind each;
//!   [`metric::DetectorMetric`], the names of a record's `metrics` the detectors read.

pub mod alert;
pub mod cell;
pub mod metric;
pub mod series_kind;
