//! The live events every server announces: a batch stored, an alert opened or
//! resolved. `GET /api/v1/events` streams them, and the webhook sender wakes on
//! them.
//!
//! Events follow commits, so a listener never hears of a step or an alert that a
//! reader cannot see yet. With SQLite the ingest service hands each commit's notices
//! to the bus right after the commit. With PostgreSQL the notices travel through the
//! database (`pg_notify` in the batch's transaction, see `store::notify`), and each
//! server's bus listens for them: a dashboard connected to one replica hears of
//! batches every replica stores, each exactly once.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{broadcast, watch};

use crate::store::Store;
use crate::store::alerts::Alert;
use crate::store::notify::{CHANNEL, Notice};

/// Events a slow listener may fall behind by before it misses some.
const EVENT_BUFFER: usize = 4096;

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

/// Where events are announced, and heard.
pub struct EventBus {
    store: Arc<Store>,
    sender: broadcast::Sender<Event>,
    /// Whether this server hears every commit: always with SQLite; with PostgreSQL
    /// while its `LISTEN` session is up.
    hearing: std::sync::atomic::AtomicBool,
}

impl EventBus {
    /// The bus of `store`; with PostgreSQL, also the task that listens for every
    /// replica's notices, until `shutdown` turns true.
    pub fn start(store: Arc<Store>, shutdown: watch::Receiver<bool>) -> Arc<EventBus> {
        let remote = store.announces_commits();
        let bus = Arc::new(EventBus {
            store,
            sender: broadcast::channel(EVENT_BUFFER).0,
            hearing: std::sync::atomic::AtomicBool::new(!remote),
        });
        if remote {
            tokio::spawn(bus.clone().listen(shutdown));
        }
        bus
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.sender.subscribe()
    }

    /// Whether this server hears every commit now (a replica whose `LISTEN` session
    /// is down would miss other replicas' events: it is not ready).
    pub fn hearing(&self) -> bool {
        self.hearing.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_hearing(&self, hearing: bool) {
        self.hearing
            .store(hearing, std::sync::atomic::Ordering::Release);
    }

    /// What a commit announces. With PostgreSQL the notices already went out with
    /// the commit, and come back through [`EventBus::listen`].
    pub async fn committed(&self, notices: Vec<Notice>) {
        if self.store.announces_commits() {
            return;
        }
        for notice in notices {
            self.announce(notice).await;
        }
    }

    /// Turns a notice into its event (reading the alert it names) and sends it to
    /// every local listener.
    async fn announce(&self, notice: Notice) {
        let event = match notice {
            Notice::Step {
                run_id,
                last_step,
                accepted,
            } => Event::Step {
                run_id,
                last_step,
                accepted,
            },
            Notice::Alert { id, resolved } => match self.store.alert(id).await {
                Ok(Some(alert)) => {
                    if resolved {
                        tracing::info!(run_id = %alert.run_id, kind = %alert.kind, subject = %alert.subject, "alert resolved");
                    } else {
                        tracing::warn!(run_id = %alert.run_id, kind = %alert.kind, subject = %alert.subject, "alert opened: {}", alert.title);
                    }
                    Event::Alert {
                        action: if resolved {
                            AlertAction::Resolved
                        } else {
                            AlertAction::Opened
                        },
                        alert: Box::new(alert),
                    }
                }
                // Deleted with its run since: nothing left to say.
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(%error, id, "cannot read an alert to announce it");
                    return;
                }
            },
        };
        // No listener is not an error.
        let _ = self.sender.send(event);
    }

    /// Hears every replica's notices (PostgreSQL `LISTEN`), reconnecting when the
    /// database goes away; notices sent meanwhile are lost, as a lagging listener's
    /// would be.
    async fn listen(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut delay = Duration::from_millis(250);
        loop {
            let listener = tokio::select! {
                listener = self.store.listen(CHANNEL) => listener,
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            let mut listener = match listener {
                Ok(listener) => {
                    delay = Duration::from_millis(250);
                    self.set_hearing(true);
                    listener
                }
                Err(error) => {
                    tracing::debug!(%error, "cannot listen for events yet; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = shutdown.wait_for(|stop| *stop) => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            loop {
                let received = tokio::select! {
                    received = listener.recv() => received,
                    _ = shutdown.wait_for(|stop| *stop) => return,
                };
                match received {
                    Ok(notification) => match serde_json::from_str(notification.payload()) {
                        Ok(notice) => self.announce(notice).await,
                        Err(error) => {
                            tracing::warn!(%error, payload = notification.payload(), "an event notice that does not parse")
                        }
                    },
                    Err(error) => {
                        self.set_hearing(false);
                        tracing::warn!(%error, "lost the event listener's connection; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}
