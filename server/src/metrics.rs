//! `GET /metrics`: the server's own health in the Prometheus text format
//! (OpenMetrics 1.0, which Prometheus scrapes as is): steps and values ingested,
//! batch latency, rejected requests by reason, open alerts by kind and severity,
//! runs, and the database's size.
//!
//! Counters and the histogram are updated where things happen; the gauges are read
//! from the store at scrape time, so they are never stale and cost nothing between
//! scrapes. The endpoint and the middleware that counts rejections are in
//! `routes/metrics.rs`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AlertLabels {
    kind: String,
    severity: String,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    ingested_steps: Counter,
    ingested_values: Counter,
    batch_seconds: Histogram,
    rejected: Family<ReasonLabels, Counter>,
    open_alerts: Family<AlertLabels, Gauge>,
    runs: Gauge,
    database_bytes: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("gradflow");
        let ingested_steps = Counter::default();
        registry.register(
            "ingested_steps",
            "Step records stored (duplicates not counted)",
            ingested_steps.clone(),
        );
        let ingested_values = Counter::default();
        registry.register(
            "ingested_values",
            "Values stored: every measured number of every stored step, derived group norms included",
            ingested_values.clone(),
        );
        // 1 ms to ~16 s: a small batch on a fast disk to a huge one on a slow disk.
        let batch_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "ingest_batch_duration_seconds",
            "Time to answer an accepted POST .../steps, body reading to commit",
            batch_seconds.clone(),
        );
        let rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "rejected_requests",
            "Requests answered with an error, by the error's code",
            rejected.clone(),
        );
        let open_alerts = Family::<AlertLabels, Gauge>::default();
        registry.register(
            "open_alerts",
            "Open alerts across all runs, by kind and severity",
            open_alerts.clone(),
        );
        let runs = Gauge::default();
        registry.register("runs", "Runs stored", runs.clone());
        let database_bytes = Gauge::default();
        registry.register(
            "database_size_bytes",
            "Size of the SQLite database file (write-ahead log not counted)",
            database_bytes.clone(),
        );
        Metrics {
            registry,
            ingested_steps,
            ingested_values,
            batch_seconds,
            rejected,
            open_alerts,
            runs,
            database_bytes,
        }
    }

    /// A batch was stored: `steps` records, `values` values, in `seconds`.
    pub fn batch_stored(&self, steps: usize, values: usize, seconds: f64) {
        self.ingested_steps.inc_by(steps as u64);
        self.ingested_values.inc_by(values as u64);
        self.batch_seconds.observe(seconds);
    }

    /// A request was answered with the API error `reason`.
    pub fn rejected(&self, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// What `/metrics` reads from the store at scrape time.
pub struct StoreGauges {
    /// Open alerts: (kind, severity, count).
    pub open_alerts: Vec<(String, String, u64)>,
    pub runs: u64,
    pub database_bytes: u64,
}

impl Metrics {
    /// The metrics in the OpenMetrics text format, with the gauges read from the store.
    pub fn render(&self, gauges: StoreGauges) -> Result<String, std::fmt::Error> {
        // Kinds that closed since the last scrape must read 0, not keep their last value.
        self.open_alerts.clear();
        for (kind, severity, n) in gauges.open_alerts {
            self.open_alerts
                .get_or_create(&AlertLabels { kind, severity })
                .set(n as i64);
        }
        self.runs.set(gauges.runs as i64);
        self.database_bytes.set(gauges.database_bytes as i64);
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}
