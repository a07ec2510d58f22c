//! What a commit announces to every server on the database.
//!
//! With PostgreSQL several replicas share one database, and a dashboard connected to
//! one of them must hear of a batch another stored. Each batch's transaction sends
//! its notices with `pg_notify` on [`CHANNEL`]; PostgreSQL delivers them when, and
//! only if, the transaction commits, to every listening session, the sender's own
//! included — so each replica's event bus hears every batch exactly once, and never
//! one that rolled back. A payload must stay under 8,000 bytes, so an alert travels
//! as its id, and each replica reads the alert itself. SQLite has one server; its
//! notices go straight to the local bus after the commit.

use serde::{Deserialize, Serialize};
use sqlx::postgres::PgListener;

use super::{BatchWrite, Db, Store, StoreError, StoreResult, Tx, Written};

/// The `LISTEN`/`NOTIFY` channel.
pub const CHANNEL: &str = "gradflow_events";

/// One announcement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Notice {
    /// A batch was stored.
    Step {
        run_id: String,
        last_step: u64,
        accepted: usize,
    },
    /// An alert opened (`resolved: false`) or resolved.
    Alert { id: i64, resolved: bool },
}

impl Notice {
    /// What a committed batch announces: its progress, then every alert it opened
    /// and resolved.
    pub fn of_batch(batch: &BatchWrite, written: &Written) -> Vec<Notice> {
        let mut notices: Vec<Notice> = batch
            .progress
            .last_step
            .filter(|_| batch.progress.steps > 0)
            .map(|last_step| Notice::Step {
                run_id: batch.run_id.clone(),
                last_step,
                accepted: batch.progress.steps as usize,
            })
            .into_iter()
            .collect();
        notices.extend(written.opened.iter().map(|&id| Notice::opened(id)));
        notices.extend(written.resolved.iter().map(|&id| Notice::resolved(id)));
        notices
    }

    pub fn opened(id: i64) -> Notice {
        Notice::Alert {
            id,
            resolved: false,
        }
    }

    pub fn resolved(id: i64) -> Notice {
        Notice::Alert { id, resolved: true }
    }
}

/// Queues `notices` in the transaction (PostgreSQL only): delivered at its commit.
pub(super) async fn send(tx: &mut Tx, notices: &[Notice]) -> StoreResult<()> {
    let Tx::Postgres(tx) = tx else {
        return Ok(());
    };
    for notice in notices {
        let payload = serde_json::to_string(notice).map_err(anyhow::Error::new)?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(payload)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

impl Store {
    /// A session listening for notices on `channel` (PostgreSQL; SQLite has one
    /// server, which hears its own commits directly).
    pub async fn listen(&self, channel: &str) -> StoreResult<PgListener> {
        self.check_ready()?;
        match &self.db {
            Db::Postgres(db) => db.listen(channel).await,
            Db::Sqlite(_) => Err(StoreError::Internal(anyhow::anyhow!(
                "SQLite has no notifications to listen for"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_are_small_and_read_back() {
        let notice = Notice::Step {
            run_id: "r".repeat(128),
            last_step: u64::MAX,
            accepted: 100_000,
        };
        let text = serde_json::to_string(&notice).unwrap();
        assert!(text.len() < 8000);
        assert_eq!(serde_json::from_str::<Notice>(&text).unwrap(), notice);
        let text = serde_json::to_string(&Notice::resolved(7)).unwrap();
        assert_eq!(text, r#"{"type":"alert","id":7,"resolved":true}"#);
    }
}
