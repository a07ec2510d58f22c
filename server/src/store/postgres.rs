//! PostgreSQL, for teams: one database that outlives any server host, which several
//! `gradflow-server` replicas share.
//!
//! The pool connects lazily and the migrations are applied by a background task
//! that retries with backoff, so a server started before its database (a compose
//! stack coming up, a database restarting) serves `503 storage_unavailable` and
//! says "not ready" at `/readyz` until the database answers, instead of exiting.
//! sqlx's migrator takes an advisory lock, so replicas starting together apply each
//! migration once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};

use super::{StoreError, StoreResult};

/// Connections per server.
const MAX_CONNECTIONS: u32 = 16;
/// How long a request waits for a connection (or for the database to answer a new
/// one) before it is answered `503`.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait between two attempts to reach the database at start.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

pub(crate) struct PgDb {
    pub pool: PgPool,
    readiness: Arc<Readiness>,
    migrations: tokio::task::JoinHandle<()>,
}

/// Whether the database has been reached and migrated, and if not, why.
#[derive(Default)]
struct Readiness {
    state: Mutex<Option<String>>,
    ready: std::sync::atomic::AtomicBool,
}

impl PgDb {
    /// A pool on `url` (checked, not yet connected) and the task that migrates it.
    pub fn open(url: &str) -> anyhow::Result<PgDb> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e| anyhow::anyhow!("the PostgreSQL URL is invalid: {e}"))?;
        let options = options.application_name("gradflow-server");
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(options);
        let readiness = Arc::new(Readiness::default());
        *readiness.state.lock().expect("not poisoned") =
            Some("the database has not been reached yet".to_owned());
        let migrations = tokio::spawn(migrate(pool.clone(), readiness.clone()));
        Ok(PgDb {
            pool,
            readiness,
            migrations,
        })
    }

    /// `Unavailable` until the database has been reached and migrated.
    pub fn check_ready(&self) -> StoreResult<()> {
        if self
            .readiness
            .ready
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        let why = self
            .readiness
            .state
            .lock()
            .expect("not poisoned")
            .clone()
            .unwrap_or_default();
        Err(StoreError::Unavailable(format!(
            "the database is not ready: {why}"
        )))
    }

    pub async fn close(&self) {
        self.migrations.abort();
        self.pool.close().await;
    }

    /// Runs `work` holding the session advisory lock named `name`, unless another
    /// session holds it: then `None`. The lock lives on a connection of its own,
    /// held for the work's duration, so a server that dies mid-work releases it.
    pub async fn exclusively<T>(
        &self,
        name: &str,
        work: impl AsyncFnOnce() -> StoreResult<T>,
    ) -> StoreResult<Option<T>> {
        let mut conn = self.pool.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
            .bind(name)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(None);
        }
        let result = work().await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(name)
            .execute(&mut *conn)
            .await;
        if let Err(error) = unlocked {
            // The lock goes with the connection.
            tracing::warn!(%error, name, "could not release an advisory lock; closing its connection");
            conn.detach();
        }
        result.map(Some)
    }

    /// A session listening on `channel`.
    pub async fn listen(&self, channel: &str) -> StoreResult<PgListener> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(channel).await?;
        Ok(listener)
    }
}

/// Applies the migrations, retrying with backoff until the database answers.
async fn migrate(pool: PgPool, readiness: Arc<Readiness>) {
    let mut delay = Duration::from_millis(250);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match sqlx::migrate!("../migrations/postgres").run(&pool).await {
            Ok(()) => {
                *readiness.state.lock().expect("not poisoned") = None;
                readiness
                    .ready
                    .store(true, std::sync::atomic::Ordering::Release);
                if attempts > 1 {
                    tracing::info!(attempts, "the database is reachable and migrated");
                }
                return;
            }
            Err(error) => {
                let why = error.to_string();
                // The first failure and then every tenth: a database that is down for
                // long must not flood the log.
                if attempts == 1 || attempts.is_multiple_of(10) {
                    tracing::warn!(attempts, error = %why, "cannot reach or migrate the database yet; retrying");
                }
                *readiness.state.lock().expect("not poisoned") = Some(why);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Whether a SQLSTATE is a condition that passes: connection exceptions (08),
/// transaction rollbacks such as serialization failures and deadlocks (40),
/// insufficient resources such as a full disk (53), operator intervention such as
/// an administrator shutdown or a crash recovery (57), a lock not available (55P03),
/// a read-only transaction on a standby (25006).
pub(crate) fn is_transient_sqlstate(code: &str) -> bool {
    ["08", "40", "53", "57"]
        .iter()
        .any(|class| code.starts_with(class))
        || code == "55P03"
        || code == "25006"
}
