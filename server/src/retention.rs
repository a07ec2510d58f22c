//! `--retain-days`: runs that have received nothing for that long are deleted, at
//! startup and then every hour, and their space is given back to the file system
//! (`Store::expire_runs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::store::{Store, now_seconds};

/// How often expired runs are looked for.
const EVERY: Duration = Duration::from_secs(3600);
/// How soon a failed round (the database unreachable, say) is tried again.
const RETRY: Duration = Duration::from_secs(60);

/// Expires runs older than `days`, now and every hour, until `shutdown` turns true.
/// With several servers on one database, one at a time does it (the store's
/// `exclusively`), and the others find nothing left to expire.
pub async fn run(store: Arc<Store>, days: u32, mut shutdown: watch::Receiver<bool>) {
    let max_age = f64::from(days) * 86_400.0;
    let mut ticks = tokio::time::interval(EVERY);
    loop {
        // The first tick is immediate.
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        match store.expire_runs(now_seconds() - max_age).await {
            Ok(deleted) if !deleted.is_empty() => {
                let steps: u64 = deleted.iter().map(|(_, steps)| steps).sum();
                tracing::info!(
                    runs = deleted.len(),
                    steps,
                    days,
                    "retention: deleted runs idle longer than --retain-days"
                );
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "retention: could not expire runs; retrying in a minute");
                ticks.reset_after(RETRY);
            }
        }
    }
}
