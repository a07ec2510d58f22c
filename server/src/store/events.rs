//! What the store announces after each commit, for the live event stream
//! (`GET /api/v1/events`). Sent only after the transaction committed, so a listener
//! never hears of a step or an alert that a reader cannot see yet.

use serde::Serialize;

use super::alerts::Alert;

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// A batch was stored.
    Step {
        run_id: String,
        last_step: u64,
        accepted: usize,
    },
    /// An alert opened or resolved.
    Alert {
        action: AlertAction,
        alert: Box<Alert>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertAction {
    Opened,
    Resolved,
}

impl Event {
    pub fn run_id(&self) -> &str {
        match self {
            Event::Step { run_id, .. } => run_id,
            Event::Alert { alert, .. } => &alert.run_id,
        }
    }

    /// The SSE event name.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Step { .. } => "step",
            Event::Alert { .. } => "alert",
        }
    }
}
