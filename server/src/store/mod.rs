//! All SQL lives here, for both databases gradflow runs on: SQLite (the embedded
//! default, one file) and PostgreSQL (one database several server replicas share).
//! The store only persists and reads; what a batch means (run state, detectors,
//! alert episodes, events) is the ingest service's (`crate::ingest`).
//!
//! The SQL is written once wherever the two dialects agree, which is nearly
//! everywhere: `$1`-style placeholders (SQLite reads them too), `RETURNING`,
//! `ON CONFLICT … DO UPDATE`, `CAST(… AS TEXT)` for typed NULL parameters, `BIGINT`
//! and `DOUBLE PRECISION` values. The macros [`with_reader!`] and [`on_tx!`] run one
//! body against whichever backend is open; the few places the dialects differ ask
//! [`Dialect`]. Backend specifics (connecting, migrations, error classes, SQLite's
//! pragmas, PostgreSQL's row locks and notifications) live in `sqlite` and
//! `postgres`.
//!
//! # Layout
//!
//! - [`codec`]: a step's values packed into one compressed blob.
//! - [`columns`]: the per-run column dictionary (which blob position holds what).
//! - [`flatten`]: a step record → a row of cells, deriving group norms.
//! - [`rollup`]: per-bucket extremes that keep long-range reads fast.
//! - [`alerts`]: alerts as stored and read.
//! - [`webhooks`]: webhook receivers and the delivery queue.
//! - [`notify`]: what a commit announces to every replica.
//! - `runs`: registering, listing, reading and deleting runs.
//! - `write`: a batch's rows written in one transaction ([`BatchWrite`]).
//! - `load`: what ingest needs to know of a run, read back.
//! - `read`: series reads over raw rows and rollups.
//! - `sqlite`, `postgres`: opening each database and what only it has.

pub mod alerts;
mod load;
pub mod notify;
mod postgres;
pub mod ranks_read;
mod read;
mod runs;
mod sqlite;
pub mod webhooks;
mod write;

use std::path::PathBuf;

use anyhow::Context;

pub use load::{LoadedRun, RunHead, last_present};
pub use read::{LatestValues, RUN_STREAM, SeriesData, SeriesRequest, rank_stream};
pub use runs::{NewRun, Registered, RunStatus, RunSummary, STALE_AFTER_SECONDS, StoredRun};
pub use write::{AlertOp, BatchWrite, BlockWrite, NewColumn, Progress, RollupRow, Written};

/// Where the data lives, as given by `--database` (or `--db`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseUrl {
    /// A SQLite file: a path, or `sqlite://path`.
    Sqlite(PathBuf),
    /// A PostgreSQL database: `postgres://user:password@host:port/db?…`.
    Postgres(String),
}

impl DatabaseUrl {
    /// Reads `--database`: `postgres://` and `postgresql://` URLs are PostgreSQL,
    /// `sqlite://path` and anything else a SQLite file's path.
    pub fn parse(text: &str) -> Result<DatabaseUrl, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("the database URL is empty".to_owned());
        }
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            // Parsed for real here, so a malformed URL is refused at start with what is
            // wrong, not at the first connection attempt.
            text.parse::<sqlx::postgres::PgConnectOptions>()
                .map_err(|e| format!("{}: {e}", redact_password(text)))?;
            return Ok(DatabaseUrl::Postgres(text.to_owned()));
        }
        if let Some(path) = text.strip_prefix("sqlite://") {
            return Ok(DatabaseUrl::Sqlite(PathBuf::from(path)));
        }
        if let Some((scheme, _)) = text.split_once("://") {
            return Err(format!(
                "unsupported database URL scheme {scheme:?}: use postgres://… for PostgreSQL, \
                 or a file path (or sqlite://path) for SQLite"
            ));
        }
        Ok(DatabaseUrl::Sqlite(PathBuf::from(text)))
    }

    /// The URL as it may be logged: a password is replaced by `***`.
    pub fn display(&self) -> String {
        match self {
            DatabaseUrl::Sqlite(path) => path.display().to_string(),
            DatabaseUrl::Postgres(url) => redact_password(url),
        }
    }

    pub fn is_postgres(&self) -> bool {
        matches!(self, DatabaseUrl::Postgres(_))
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((credentials, host)) => match credentials.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// When a SQLite commit reaches the disk (PostgreSQL follows its own
/// `synchronous_commit`, which defaults to every commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// fsync the WAL on every commit: an acknowledged batch survives a power cut.
    Full,
    /// fsync only at checkpoints: an acknowledged batch survives a killed server but
    /// not a power cut.
    Normal,
}

/// How to open the store.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub database: DatabaseUrl,
    pub sync: SyncMode,
}

/// What a store operation can fail with, each mapped to one HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("run {0:?} is not registered")]
    RunNotFound(String),
    /// The database cannot take writes right now (disk full, locked, read-only,
    /// unreachable, restarting): the request may be retried.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// A batch was prepared against a run state that another writer has moved on
    /// since; the ingest service reloads and prepares it again.
    #[error("the run moved on while the batch was prepared")]
    Stale,
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        if is_transient(&error) {
            StoreError::Unavailable(error.to_string())
        } else {
            StoreError::Internal(anyhow::Error::new(error))
        }
    }
}

/// Whether an error passes with time: the database is busy, full, read-only,
/// restarting or out of reach, rather than the request being wrong.
fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => {
            if let Some(pg) = database.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                postgres::is_transient_sqlstate(pg.code())
            } else {
                sqlite::is_transient_code(database.code().as_deref())
            }
        }
        _ => false,
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Which SQL dialect a statement is for, where the two differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// `a <op> b` true when both are NULL or equal.
    pub fn is_same(self) -> &'static str {
        match self {
            Dialect::Sqlite => "IS",
            Dialect::Postgres => "IS NOT DISTINCT FROM",
        }
    }

    /// Locks the rows a `SELECT` returns for the transaction, skipping rows another
    /// transaction holds (PostgreSQL); SQLite has one writer and needs nothing.
    pub fn skip_locked(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE SKIP LOCKED",
        }
    }
}

/// The open database.
pub(crate) enum Db {
    Sqlite(sqlite::SqliteDb),
    Postgres(postgres::PgDb),
}

/// A write transaction on either database; dropped without [`Tx::commit`], it
/// rolls back.
pub(crate) enum Tx {
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
}

impl Tx {
    pub(crate) async fn commit(self) -> StoreResult<()> {
        match self {
            Tx::Sqlite(tx) => tx.commit().await?,
            Tx::Postgres(tx) => tx.commit().await?,
        }
        Ok(())
    }

    pub(crate) fn dialect(&self) -> Dialect {
        match self {
            Tx::Sqlite(_) => Dialect::Sqlite,
            Tx::Postgres(_) => Dialect::Postgres,
        }
    }
}

/// Runs `$body` with `$c` bound to the connection of the transaction `$tx`
/// (`&mut Tx`), whichever database it is on: the body is compiled once per backend.
macro_rules! on_tx {
    ($tx:expr, |$c:ident| $body:expr) => {
        match $tx {
            $crate::store::Tx::Sqlite(t) => {
                let $c: &mut sqlx::SqliteConnection = &mut **t;
                $body
            }
            $crate::store::Tx::Postgres(t) => {
                let $c: &mut sqlx::PgConnection = &mut **t;
                $body
            }
        }
    };
}

/// Runs `$body` with `$c` bound to the pool that serves reads of `$store`.
macro_rules! with_reader {
    ($store:expr, |$c:ident| $body:expr) => {
        match &$store.db {
            $crate::store::Db::Sqlite(db) => {
                let $c = &db.read;
                $body
            }
            $crate::store::Db::Postgres(db) => {
                let $c = &db.pool;
                $body
            }
        }
    };
}

pub(crate) use {on_tx, with_reader};

/// The store: one database, SQLite or PostgreSQL.
pub struct Store {
    pub(crate) db: Db,
}

impl Store {
    /// Opens the database and applies its migrations. SQLite is opened (and created)
    /// at once, so a path that cannot be opened is an error here. PostgreSQL is
    /// reached in the background, with backoff, so a server started before its
    /// database comes up serves `503` (and `/readyz` says not ready) until it can.
    pub async fn open(config: &StoreConfig) -> anyhow::Result<Store> {
        let db = match &config.database {
            DatabaseUrl::Sqlite(path) => Db::Sqlite(
                sqlite::SqliteDb::open(path, config.sync)
                    .await
                    .with_context(|| format!("opening the SQLite database {}", path.display()))?,
            ),
            DatabaseUrl::Postgres(url) => Db::Postgres(postgres::PgDb::open(url)?),
        };
        Ok(Store { db })
    }

    /// Which database this is.
    pub fn dialect(&self) -> Dialect {
        match &self.db {
            Db::Sqlite(_) => Dialect::Sqlite,
            Db::Postgres(_) => Dialect::Postgres,
        }
    }

    /// Whether each commit's notices reach every server through the database
    /// itself (PostgreSQL's `NOTIFY`, heard back through `LISTEN`), rather than being
    /// announced by the server that committed.
    pub fn announces_commits(&self) -> bool {
        self.dialect() == Dialect::Postgres
    }

    /// Whether one server at a time uses this database (a SQLite file), so that what
    /// another server left in it, such as a webhook delivery claim, is a crashed
    /// predecessor's.
    pub fn single_server(&self) -> bool {
        self.dialect() == Dialect::Sqlite
    }

    /// Whether the database is reachable and migrated: a round trip to it.
    pub async fn ready(&self) -> StoreResult<()> {
        self.check_ready()?;
        with_reader!(self, |pool| {
            sqlx::query("SELECT 1").execute(pool).await?;
        });
        Ok(())
    }

    /// Waits (up to a minute) for [`Store::ready`], for tools that run against the
    /// database once, such as `gradflow-server import`.
    pub async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match self.ready().await {
                Ok(()) => return Ok(()),
                Err(error) if std::time::Instant::now() >= deadline => {
                    return Err(anyhow::anyhow!(
                        "the database is not ready after a minute: {error}"
                    ));
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
            }
        }
    }

    /// `Unavailable` until PostgreSQL has been reached and migrated.
    fn check_ready(&self) -> StoreResult<()> {
        match &self.db {
            Db::Sqlite(_) => Ok(()),
            Db::Postgres(db) => db.check_ready(),
        }
    }

    /// Waits for the batch in flight and closes the database (checkpointing SQLite's
    /// WAL into the main file). Takes `&self`: when the server stops, the last
    /// connection task may still hold a handle on the store for a moment.
    pub async fn close(&self) -> anyhow::Result<()> {
        match &self.db {
            Db::Sqlite(db) => db.close().await,
            Db::Postgres(db) => {
                db.close().await;
                Ok(())
            }
        }
    }

    /// A write transaction.
    pub(crate) async fn begin(&self) -> StoreResult<Tx> {
        self.check_ready()?;
        Ok(match &self.db {
            Db::Sqlite(db) => Tx::Sqlite(db.write.begin().await?),
            Db::Postgres(db) => Tx::Postgres(db.pool.begin().await?),
        })
    }

    /// Bytes the database takes: the SQLite file's pages (free ones included; the
    /// write-ahead log is folded in at checkpoints), or PostgreSQL's
    /// `pg_database_size`.
    pub async fn database_bytes(&self) -> StoreResult<u64> {
        self.check_ready()?;
        let bytes: i64 =
            match &self.db {
                Db::Sqlite(db) => sqlx::query_scalar(
                    "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
                )
                .fetch_one(&db.read)
                .await?,
                Db::Postgres(db) => {
                    sqlx::query_scalar("SELECT pg_database_size(current_database())")
                        .fetch_one(&db.pool)
                        .await?
                }
            };
        Ok(bytes.max(0) as u64)
    }

    /// How many runs are stored.
    pub async fn run_count(&self) -> StoreResult<u64> {
        self.check_ready()?;
        let n: i64 = with_reader!(self, |pool| {
            sqlx::query_scalar("SELECT count(*) FROM runs")
                .fetch_one(pool)
                .await?
        });
        Ok(n as u64)
    }

    /// Runs `work` while holding the database-wide lock named `name`, if no other
    /// server holds it now: `None` when another replica is doing the same work
    /// (retention, for one, runs on one replica at a time). SQLite has one server.
    pub async fn exclusively<T>(
        &self,
        name: &str,
        work: impl AsyncFnOnce() -> StoreResult<T>,
    ) -> StoreResult<Option<T>> {
        self.check_ready()?;
        match &self.db {
            Db::Sqlite(_) => Ok(Some(work().await?)),
            Db::Postgres(db) => db.exclusively(name, work).await,
        }
    }
}

/// Seconds since the Unix epoch, as stored in `created_at` and `last_seen`.
pub fn now_seconds() -> f64 {
    gradflow_protocol::Timestamp::now().unix_seconds()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_pick_the_backend() {
        assert_eq!(
            DatabaseUrl::parse("./gradflow.db"),
            Ok(DatabaseUrl::Sqlite("./gradflow.db".into()))
        );
        assert_eq!(
            DatabaseUrl::parse("sqlite:///var/lib/g.db"),
            Ok(DatabaseUrl::Sqlite("/var/lib/g.db".into()))
        );
        let pg = DatabaseUrl::parse("postgres://gf:secret@db:5432/gradflow").unwrap();
        assert!(pg.is_postgres());
        assert_eq!(pg.display(), "postgres://gf:***@db:5432/gradflow");
        assert!(
            DatabaseUrl::parse("postgresql://localhost/gradflow?sslmode=disable")
                .unwrap()
                .is_postgres()
        );
        let err = DatabaseUrl::parse("mysql://localhost/g").unwrap_err();
        assert!(err.contains("unsupported database URL scheme"), "{err}");
        assert!(DatabaseUrl::parse("  ").is_err());
        let err = DatabaseUrl::parse("postgres://gf:secret@db:notaport/g").unwrap_err();
        assert!(!err.contains("secret"), "{err}");
    }
}
