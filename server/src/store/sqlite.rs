//! SQLite, the embedded default: one file, one writer connection, a pool of readers
//! that WAL mode lets run beside it.
//!
//! The writer is a pool of exactly one connection, so a batch holds it from `BEGIN`
//! to `COMMIT` and others wait their turn (SQLite allows one writer anyway). A
//! transaction that failed on an I/O error (full disk, read-only file) can leave
//! sqlx's transaction bookkeeping out of step with SQLite: SQLite has rolled back,
//! or still holds a transaction its failed `ROLLBACK` could not end, while sqlx
//! counts one open. Its next `begin` would then be a `SAVEPOINT` inside it and its
//! "commit" a `RELEASE` that commits nothing: batches acknowledged and lost. So a
//! writer that comes back to the pool still counting a transaction is closed (which
//! rolls back whatever it held), and the pool opens a fresh one.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, SqliteConnection};

use super::SyncMode;
use gradflow_core::columnar::columns::SeriesKind;
use gradflow_core::columnar::{block, codec};

/// Readers open at once.
const READERS: u32 = 4;
/// How long a batch waits for the writer before the request is answered `503`.
const WRITER_WAIT: Duration = Duration::from_secs(60);

pub(crate) struct SqliteDb {
    pub read: SqlitePool,
    pub write: SqlitePool,
}

impl SqliteDb {
    /// Opens (creating if missing) the database at `path` and applies the migrations.
    pub async fn open(path: &Path, sync: SyncMode) -> anyhow::Result<SqliteDb> {
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
        sqlx::migrate!("../migrations/sqlite")
            .run(&mut conn)
            .await
            .with_context(|| format!("applying migrations to {}", path.display()))?;
        convert_step_rows(&mut conn)
            .await
            .with_context(|| format!("moving the step rows of {} into blocks", path.display()))?;
        conn.close().await.ok();
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(WRITER_WAIT)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .after_release(|conn, _| {
                Box::pin(async move {
                    // The ping runs after any rollback the dropped transaction queued,
                    // so the count below is the settled one.
                    conn.ping().await?;
                    if conn.is_in_transaction() {
                        tracing::warn!(
                            "replacing the database writer connection after a failed transaction"
                        );
                        return Ok(false);
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await
            .with_context(|| format!("opening the writer of {}", path.display()))?;
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
            .max_connections(READERS)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(read_options)
            .await
            .with_context(|| format!("opening read connections to {}", path.display()))?;
        Ok(SqliteDb { read, write })
    }

    /// Waits for the batch in flight, checkpoints the WAL into the main file and
    /// closes every connection.
    pub async fn close(&self) -> anyhow::Result<()> {
        let mut writer = self
            .write
            .acquire()
            .await
            .context("waiting for the writer")?;
        self.read.close().await;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut *writer)
            .await
            .context("checkpointing the WAL")?;
        drop(writer);
        self.write.close().await;
        Ok(())
    }

    /// Returns free pages to the file system: the database is created with
    /// `auto_vacuum = INCREMENTAL`, so `incremental_vacuum` moves pages down and
    /// truncates, and a checkpoint carries the smaller file out of the WAL. Best
    /// effort: the pages stay reusable if it cannot run now (a reader holds the WAL).
    pub async fn free_space(&self) {
        let mut writer = match self.write.acquire().await {
            Ok(writer) => writer,
            Err(error) => {
                tracing::warn!(%error, "could not free the space of deleted runs yet");
                return;
            }
        };
        for pragma in [
            "PRAGMA incremental_vacuum",
            "PRAGMA wal_checkpoint(TRUNCATE)",
        ] {
            if let Err(error) = sqlx::query(pragma).execute(&mut *writer).await {
                tracing::warn!(%error, pragma, "could not free the space of deleted runs yet");
            }
        }
    }
}

/// Steps converted at a time: a multiple of the block size.
const RANGE_STEPS: i64 = 64 * 64;

/// Moves what a database written before blocks holds in its `steps` table (one row
/// per step, `codec.rs`) into blocks, run by run, each run in one transaction (so a
/// server stopped half-way carries on where it stopped), then drops the table.
async fn convert_step_rows(conn: &mut SqliteConnection) -> anyhow::Result<()> {
    let legacy: Option<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'steps'",
    )
    .fetch_optional(&mut *conn)
    .await?;
    if legacy.is_none() {
        return Ok(());
    }
    let runs: Vec<i64> = sqlx::query_scalar("SELECT DISTINCT run FROM steps ORDER BY run")
        .fetch_all(&mut *conn)
        .await?;
    if !runs.is_empty() {
        tracing::info!(
            runs = runs.len(),
            "moving step rows into blocks (once, after an upgrade)"
        );
    }
    let mut decompressor = codec::decompressor()?;
    let mut converted = 0u64;
    for run in runs {
        let kinds: Vec<(i64, String)> =
            sqlx::query_as("SELECT col, kind FROM columns WHERE run = $1")
                .bind(run)
                .fetch_all(&mut *conn)
                .await?;
        let mut families: Vec<Option<SeriesKind>> = Vec::new();
        for (col, kind) in kinds {
            let col = col as usize;
            if families.len() <= col {
                families.resize(col + 1, None);
            }
            families[col] = SeriesKind::parse(&kind);
        }
        let mut tx = conn.begin().await?;
        // A range of blocks at a time, so a long run never sits in memory whole.
        let mut from = 0i64;
        loop {
            let to = from + RANGE_STEPS;
            let rows: Vec<(i64, Option<f64>, Vec<u8>)> = sqlx::query_as(
                "SELECT step, time, vals FROM steps WHERE run = $1 AND step >= $2 \
                 AND step < $3 ORDER BY step",
            )
            .bind(run)
            .bind(from)
            .bind(to)
            .fetch_all(&mut *tx)
            .await?;
            let last: Option<i64> =
                sqlx::query_scalar("SELECT max(step) FROM steps WHERE run = $1")
                    .bind(run)
                    .fetch_one(&mut *tx)
                    .await?;
            let mut decoded = Vec::with_capacity(rows.len());
            for (step, time, blob) in &rows {
                let packed = codec::Packed::decode(blob, &mut decompressor)
                    .with_context(|| format!("decoding step {step} of run #{run}"))?;
                let cells: Vec<u32> = (0..packed.column_count()).map(|c| packed.bits(c)).collect();
                decoded.push((*step as u64, *time, cells));
            }
            for group in decoded.chunk_by(|a, b| block::block_index(a.0) == block::block_index(b.0))
            {
                let index = block::block_index(group[0].0);
                let block_rows: Vec<block::BlockRow<'_>> = group
                    .iter()
                    .map(|(step, time, cells)| block::BlockRow {
                        step: *step,
                        time: *time,
                        cells,
                    })
                    .collect();
                let blob = block::encode(index, &block_rows, &families)?;
                let mask = block::peek(&blob)?.mask;
                sqlx::query(
                    "INSERT INTO blocks (run, stream, block, mask, vals) \
                     VALUES ($1, 0, $2, $3, $4) ON CONFLICT (run, stream, block) \
                     DO UPDATE SET mask = excluded.mask, vals = excluded.vals",
                )
                .bind(run)
                .bind(index as i64)
                .bind(mask as i64)
                .bind(blob)
                .execute(&mut *tx)
                .await?;
            }
            converted += rows.len() as u64;
            if last.is_none_or(|last| last < to) {
                break;
            }
            from = to;
        }
        sqlx::query("DELETE FROM steps WHERE run = $1")
            .bind(run)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    sqlx::query("DROP TABLE steps").execute(&mut *conn).await?;
    if converted > 0 {
        tracing::info!(steps = converted, "moved step rows into blocks");
    }
    Ok(())
}

/// Whether a SQLite result code is a condition that passes: BUSY, LOCKED, READONLY,
/// IOERR, FULL, CANTOPEN (primary codes; extended codes carry them in the low byte).
pub(crate) fn is_transient_code(code: Option<&str>) -> bool {
    const TRANSIENT: [i64; 6] = [5, 6, 8, 10, 13, 14];
    code.and_then(|c| c.parse::<i64>().ok())
        .is_some_and(|code| TRANSIENT.contains(&(code & 0xff)))
}
