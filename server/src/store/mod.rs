//! All SQL lives here. The store owns the SQLite file: one writer connection behind
//! an async mutex (SQLite allows one writer at a time anyway, and serialising batches
//! here makes duplicate detection and column assignment race-free), and a pool of
//! readers that WAL mode lets run beside it.
//!
//! # Layout
//!
//! - [`codec`]: a step's values packed into one compressed blob.
//! - [`columns`]: the per-run column dictionary (which blob position holds what).
//! - [`flatten`]: a step record → a row of cells, deriving group norms.
//! - [`rollup`]: per-bucket extremes that keep long-range reads fast.
//! - [`alerts`]: alerts as stored, written from detector transitions.
//! - [`events`]: what is announced after each commit.
//! - `runs`: registration, listing, reading and deleting runs.
//! - `ingest`: the all-or-nothing batch transaction.
//! - `read`: series reads over raw rows and rollups.
//! - [`webhooks`]: webhook receivers and the delivery queue.

pub mod alerts;
pub mod codec;
pub mod columns;
pub mod events;
pub mod flatten;
mod ingest;
mod read;
pub mod rollup;
mod runs;
pub mod webhooks;

use std::collections::HashMap;

use rustc_hash::{FxHashMap, FxHashSet};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gradflow_protocol::{Amendment, InvalidBody, RunRegistration};
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, SqliteConnection};
use tokio::sync::{Mutex, broadcast};

pub use ingest::IngestOutcome;
pub use read::{LatestValues, SeriesData, SeriesRequest};
pub use runs::{RunStatus, RunSummary, STALE_AFTER_SECONDS, StoredRun};

use crate::detect::{Detection, DetectorSet, RunContext, Thresholds};
use alerts::OpenEpisodes;
use columns::{ColumnDictionary, SeriesKind};
use events::Event;

/// When a commit reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncMode {
    /// fsync the WAL on every commit: an acknowledged batch survives a power cut.
    Full,
    /// fsync only at checkpoints: an acknowledged batch survives a killed server but
    /// not a power cut.
    Normal,
}

/// What a store operation can fail with, each mapped to one HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("run {0:?} is not registered")]
    RunNotFound(String),
    #[error(transparent)]
    Invalid(InvalidBody),
    #[error("{message}")]
    Conflict { path: String, message: String },
    /// The database cannot take writes right now (disk full, locked, read-only):
    /// the request may be retried.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        // SQLite's primary result codes for conditions that pass: BUSY, LOCKED,
        // READONLY, IOERR, FULL, CANTOPEN.
        const TRANSIENT: [i64; 6] = [5, 6, 8, 10, 13, 14];
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .and_then(|c| c.parse::<i64>().ok());
        match code {
            Some(code) if TRANSIENT.contains(&(code & 0xff)) => {
                StoreError::Unavailable(error.to_string())
            }
            _ => StoreError::Internal(anyhow::Error::new(error)),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// The SQLite-backed store.
pub struct Store {
    read: SqlitePool,
    writer: Mutex<Writer>,
    /// How the writer connection is opened, again when it must be replaced.
    write_options: SqliteConnectOptions,
    events: broadcast::Sender<Event>,
    detection: Detection,
}

/// Everything only the writer touches.
struct Writer {
    conn: SqliteConnection,
    /// Per-run state needed to ingest, loaded on first use and kept in step with
    /// what is committed (updated only after a commit succeeds).
    runs: HashMap<String, RunState>,
    compressor: zstd::bulk::Compressor<'static>,
    decompressor: zstd::bulk::Decompressor<'static>,
}

/// What ingesting into a run needs to know without a query.
#[derive(Debug, Clone)]
struct RunState {
    key: i64,
    last_step: Option<u64>,
    columns: ColumnDictionary,
    /// The registration in force and what is derived from it. Shared, since a batch
    /// that amends it keeps the one in force before the amendment for the records
    /// before it.
    registry: Arc<Registry>,
    detectors: DetectorSet,
    /// The run's open alert episodes.
    open: OpenEpisodes,
    /// Set while a batch's COMMIT is in flight and until the state above follows it.
    /// A batch whose future is dropped there (its request cancelled) may or may not
    /// have committed; the next batch of the run then reloads the state from what
    /// the database holds instead of trusting this copy.
    commit_in_doubt: bool,
}

/// A registration in force (as first sent, with every amendment up to some step
/// applied) and the lookups ingest derives from it.
#[derive(Debug)]
struct Registry {
    registration: RunRegistration,
    /// Parameter names: a step may only report these.
    params: FxHashSet<String>,
    /// Module → group, from the parameters.
    module_groups: FxHashMap<String, String>,
    /// What the detectors know of the run.
    context: Arc<RunContext>,
}

impl Registry {
    fn new(registration: RunRegistration, thresholds: Thresholds) -> Registry {
        Registry {
            params: registration.params.iter().map(|p| p.name.clone()).collect(),
            module_groups: registration
                .params
                .iter()
                .map(|p| (p.module_name().to_owned(), p.group_name().to_owned()))
                .collect(),
            context: Arc::new(RunContext::new(&registration, thresholds)),
            registration,
        }
    }

    /// This registration with `amendment` applied (the protocol's defaults written
    /// out, as for a registration).
    fn amended(&self, amendment: &Amendment, thresholds: Thresholds) -> Registry {
        let mut registration = self.registration.clone();
        registration.amend(amendment);
        Registry::new(registration.normalized(), thresholds)
    }
}

impl RunState {
    fn new(key: i64, registration: &RunRegistration, thresholds: Thresholds) -> RunState {
        RunState {
            key,
            last_step: None,
            columns: ColumnDictionary::default(),
            registry: Arc::new(Registry::new(registration.clone(), thresholds)),
            detectors: DetectorSet::default(),
            open: OpenEpisodes::new(),
            commit_in_doubt: false,
        }
    }
}

impl Store {
    /// Opens (creating if missing) the database at `path` and applies the migrations.
    /// `detection` says whether the detectors run, and their server-wide thresholds
    /// (runs may override them).
    pub async fn open(path: &Path, sync: SyncMode, detection: Detection) -> anyhow::Result<Store> {
        let url = format!("sqlite://{}", path.display());
        let options = SqliteConnectOptions::from_str(&url)
            .with_context(|| format!("parsing database path {}", path.display()))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match sync {
                SyncMode::Full => SqliteSynchronous::Full,
                SyncMode::Normal => SqliteSynchronous::Normal,
            })
            // Takes effect only when the file is created; retention frees pages with
            // incremental vacuum instead of rewriting the whole file.
            .auto_vacuum(SqliteAutoVacuum::Incremental)
            .page_size(16384)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5))
            .pragma("cache_size", "-65536"); // 64 MiB per connection
        let mut conn = SqliteConnection::connect_with(&options)
            .await
            .with_context(|| format!("opening database {}", path.display()))?;
        let write_options = options.clone();
        sqlx::migrate!("../migrations")
            .run(&mut conn)
            .await
            .with_context(|| format!("applying migrations to {}", path.display()))?;
        // Readers set nothing that writes: setting journal_mode or auto_vacuum on a
        // new connection needs the write lock, so a reader opened while the database
        // is locked, read-only or on a full disk would fail, and reads must go on
        // while writes cannot.
        let read_options = SqliteConnectOptions::from_str(&url)
            .with_context(|| format!("parsing database path {}", path.display()))?
            .read_only(true)
            .busy_timeout(Duration::from_secs(5))
            .pragma("cache_size", "-65536");
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(read_options)
            .await
            .with_context(|| format!("opening read connections to {}", path.display()))?;
        Ok(Store {
            read,
            write_options,
            events: broadcast::channel(EVENT_BUFFER).0,
            detection,
            writer: Mutex::new(Writer {
                conn,
                runs: HashMap::new(),
                compressor: codec::compressor()?,
                decompressor: codec::decompressor()?,
            }),
        })
    }

    /// Waits for the batch in flight, checkpoints the WAL into the main file and
    /// closes the readers. Takes `&self`: when the server stops, the last connection
    /// task may still hold a handle on the store for a moment.
    pub async fn close(&self) -> anyhow::Result<()> {
        let mut writer = self.lock_writer().await?;
        self.read.close().await;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut writer.conn)
            .await
            .context("checkpointing the WAL")?;
        Ok(())
    }
}

impl Store {
    /// The writer, on a connection whose state is known. A transaction that failed
    /// on an I/O error (full disk, read-only file) can leave sqlx's transaction
    /// bookkeeping out of step with SQLite: SQLite has rolled back, or still holds a
    /// transaction its failed `ROLLBACK` could not end, while sqlx counts one open.
    /// Its next `begin` would then be a `SAVEPOINT` inside it and its "commit" a
    /// `RELEASE` that commits nothing: batches acknowledged and lost. So a writer
    /// that still counts a transaction when no one holds one is replaced by a fresh
    /// connection (closing the old one rolls back whatever it held), and the cached
    /// per-run state is reloaded from what is committed.
    async fn lock_writer(&self) -> StoreResult<tokio::sync::MutexGuard<'_, Writer>> {
        let mut writer = self.writer.lock().await;
        if writer.conn.is_in_transaction() {
            let fresh = SqliteConnection::connect_with(&self.write_options)
                .await
                .map_err(|e| StoreError::Unavailable(format!("cannot reopen the database: {e}")))?;
            tracing::warn!("replaced the database writer connection after a failed transaction");
            let old = std::mem::replace(&mut writer.conn, fresh);
            if let Err(error) = old.close().await {
                tracing::debug!(%error, "closing the failed writer connection");
            }
            writer.runs.clear();
        }
        Ok(writer)
    }
}

impl Store {
    /// Bytes of the database file: its pages, free ones included (the write-ahead
    /// log is not counted; it is folded in at checkpoints).
    pub async fn database_bytes(&self) -> StoreResult<u64> {
        let bytes: i64 = sqlx::query_scalar(
            "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        )
        .fetch_one(&self.read)
        .await?;
        Ok(bytes.max(0) as u64)
    }

    /// How many runs are stored.
    pub async fn run_count(&self) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
            .fetch_one(&self.read)
            .await?;
        Ok(n as u64)
    }
}

/// Events a slow listener may fall behind by before it misses some.
const EVENT_BUFFER: usize = 4096;

impl Store {
    /// Subscribes to the events announced after each commit.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    fn announce(&self, event: Event) {
        // No listener is not an error.
        let _ = self.events.send(event);
    }
}

impl Writer {
    /// The ingest state of `run_id`, loaded from the database on first use.
    async fn run_state(
        &mut self,
        run_id: &str,
        thresholds: Thresholds,
    ) -> StoreResult<&mut RunState> {
        if self
            .runs
            .get(run_id)
            .is_none_or(|state| state.commit_in_doubt)
        {
            let state = load_run_state(&mut self.conn, run_id, thresholds).await?;
            self.runs.insert(run_id.to_owned(), state);
        }
        Ok(self.runs.get_mut(run_id).expect("inserted above"))
    }
}

async fn load_run_state(
    conn: &mut SqliteConnection,
    run_id: &str,
    thresholds: Thresholds,
) -> StoreResult<RunState> {
    let row: Option<(i64, String, Option<i64>)> =
        sqlx::query_as("SELECT id, registration, last_step FROM runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(&mut *conn)
            .await?;
    let Some((key, registration, last_step)) = row else {
        return Err(StoreError::RunNotFound(run_id.to_owned()));
    };
    let mut registration: RunRegistration = serde_json::from_str(&registration)
        .with_context(|| format!("reading the stored registration of run {run_id}"))?;
    for (_, amendment) in runs::load_amendments(&mut *conn, key).await? {
        registration.amend(&amendment);
    }
    let mut state = RunState::new(key, &registration.normalized(), thresholds);
    state.last_step = last_step.map(|s| s as u64);
    let detectors: Option<String> =
        sqlx::query_scalar("SELECT state FROM detector_state WHERE run = ?")
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
    if let Some(detectors) = detectors {
        state.detectors = serde_json::from_str(&detectors)
            .with_context(|| format!("reading the detector state of run {run_id}"))?;
    }
    state.open = alerts::load_open(conn, key).await?;
    let columns: Vec<(i64, String, String)> =
        sqlx::query_as("SELECT col, kind, subject FROM columns WHERE run = ?")
            .bind(key)
            .fetch_all(&mut *conn)
            .await?;
    for (position, kind, subject) in columns {
        let kind = SeriesKind::parse(&kind)
            .with_context(|| format!("unknown column kind {kind:?} in run {run_id}"))?;
        state.columns.restore(kind, &subject, position as u32);
    }
    Ok(state)
}

/// Seconds since the Unix epoch, as stored in `created_at` and `last_seen`.
pub fn now_seconds() -> f64 {
    gradflow_protocol::Timestamp::now().unix_seconds()
}
