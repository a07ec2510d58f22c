//! The reporter: delivers step records to the server without ever blocking training.
//!
//! The training loop hands records to a bounded queue (`try_send`: a full queue drops
//! and counts, it never waits). A thread registers the run (retrying until the server
//! answers) and takes the records off in batches, woken when a batch is full or due
//! by age rather than for every record; it encodes each batch as CBOR (protocol v1.6;
//! JSON after a server answers `415`, or when told to), gzips it (`gzip`) and POSTs it
//! with retries, exponential backoff and jitter. When the server is unreachable it
//! warns once, appends batches to a bounded spool file (`spool`), and replays it in order
//! when the server is back; new batches queue behind the spool so order is kept. At
//! exit it flushes within a deadline and says what it could not deliver.
//!
//! Given several servers (replicas of one database, or a standby started on the
//! first's database), it talks to one at a time and moves to the next when the
//! current one stops answering (`servers`); step numbers make the resent batches
//! idempotent.

mod gzip;
mod servers;
mod spool;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, bounded};
use gradflow_protocol::{RunRegistration, StepRecord};
use rand::Rng;

use gzip::Gzip;
use servers::Servers;
use spool::Spool;

#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// Base URLs, e.g. `http://127.0.0.1:7070`: the first is tried first, the others
    /// in turn when the current one stops answering.
    pub servers: Vec<String>,
    pub run_id: String,
    pub token: Option<String>,
    /// Records per POST.
    pub batch_size: usize,
    /// A batch is sent when its oldest record is this old, full or not (counted from
    /// when the reporter took it off the queue: an idle one looks every 200 ms).
    pub batch_interval: Duration,
    /// Records the queue between training and the reporter holds.
    pub queue_capacity: usize,
    pub spool_path: PathBuf,
    pub spool_max_bytes: u64,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Send step batches as CBOR (`application/cbor`, protocol v1.6), falling back to
    /// JSON for good once a server answers `415`; false sends JSON from the start.
    pub cbor: bool,
}

impl ReporterConfig {
    pub fn new(server: &str, run_id: &str) -> ReporterConfig {
        ReporterConfig {
            servers: vec![server.trim_end_matches('/').to_owned()],
            run_id: run_id.to_owned(),
            token: None,
            batch_size: 50,
            batch_interval: Duration::from_secs(1),
            queue_capacity: 4096,
            spool_path: std::env::temp_dir().join(format!("gradflow-spool-{run_id}.ndjson")),
            spool_max_bytes: 256 * 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            cbor: false,
        }
    }
}

/// What the reporter achieved, told at exit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Records the server stored.
    pub delivered: u64,
    /// Records the server already had (resends).
    pub duplicates: u64,
    /// Records the server refused as late: below the run's last stored step, never
    /// stored (another writer moved the run past them). Lost.
    pub late: u64,
    /// Records the server rejected as invalid (a bug in the client; logged).
    pub rejected: u64,
    /// Records still in the spool when the deadline passed.
    pub undelivered: u64,
    /// Records lost because the queue or the spool was full.
    pub dropped: u64,
    /// Why the run could not be registered, if it could not.
    pub registration_error: Option<String>,
    /// The spool file holding the undelivered records (its registration beside it,
    /// for `gradflow-server import`), when some are left.
    pub spool: Option<PathBuf>,
}

impl Summary {
    pub fn complete(&self) -> bool {
        self.undelivered == 0
            && self.dropped == 0
            && self.late == 0
            && self.rejected == 0
            && self.registration_error.is_none()
    }
}

pub struct Reporter {
    tx: Option<Sender<StepRecord>>,
    /// The worker, woken when a batch is ready rather than for every record: a
    /// wake-up a step cost the training thread a system call and the worker two
    /// context switches, for nothing until the batch is full.
    worker: Thread,
    batch_size: usize,
    handle: Option<JoinHandle<Summary>>,
    queue_dropped: Arc<AtomicU64>,
    deadline: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Reporter {
    /// Starts the reporter thread; it registers the run before sending any step.
    pub fn start(
        config: ReporterConfig,
        registration: RunRegistration,
    ) -> anyhow::Result<Reporter> {
        let (tx, rx) = bounded(config.queue_capacity);
        let queue_dropped = Arc::new(AtomicU64::new(0));
        let deadline = Arc::new(std::sync::Mutex::new(None));
        anyhow::ensure!(
            !config.servers.is_empty(),
            "no gradflow server to report to"
        );
        let client = reqwest::blocking::Client::builder()
            .timeout(config.request_timeout)
            .build()?;
        let batch_size = config.batch_size.max(1);
        let worker = Worker {
            spool: Spool::open(config.spool_path.clone(), config.spool_max_bytes)?,
            servers: Servers::new(config.servers.clone()),
            gzip: Gzip::new(),
            cbor: config.cbor,
            config,
            client,
            registration,
            registered: false,
            summary: Summary::default(),
            warned: false,
            warned_spool_full: false,
            queue_dropped: queue_dropped.clone(),
            deadline: deadline.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("gradflow-reporter".into())
            .spawn(move || worker.run(rx))?;
        Ok(Reporter {
            tx: Some(tx),
            worker: handle.thread().clone(),
            batch_size,
            handle: Some(handle),
            queue_dropped,
            deadline,
        })
    }

    /// Hands a record over without waiting; a full queue drops it (counted).
    pub fn report(&self, record: StepRecord) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(record).is_err() {
            self.queue_dropped.fetch_add(1, Ordering::Relaxed);
        }
        // Unparking a running thread is one atomic swap; only a parked one is woken.
        if tx.len() >= self.batch_size {
            self.worker.unpark();
        }
    }

    /// Stops taking records, delivers what it can within `deadline`, and says how it went.
    pub fn finish(mut self, deadline: Duration) -> Summary {
        *self.deadline.lock().expect("deadline lock") = Some(Instant::now() + deadline);
        drop(self.tx.take());
        self.worker.unpark();
        // The worker counts every drop, the queue's included; if it died, the
        // queue's count is all that is known.
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_else(|| Summary {
                dropped: self.queue_dropped.load(Ordering::Relaxed),
                ..Summary::default()
            })
    }
}

/// Why a POST did not deliver.
enum PostError {
    /// Connection refused, timeout, 5xx: try again later.
    Unavailable(String),
    /// The run is unknown to the server (a fresh database): register again.
    Unregistered,
    /// 4xx: the server will never take this batch.
    Rejected(String),
}

/// A `415` to a CBOR body: a server older than protocol v1.6, which takes JSON.
struct CborRefused;

struct Worker {
    config: ReporterConfig,
    client: reqwest::blocking::Client,
    servers: Servers,
    gzip: Gzip,
    /// Whether step batches go as CBOR: until a server refuses it.
    cbor: bool,
    registration: RunRegistration,
    registered: bool,
    spool: Spool,
    summary: Summary,
    warned: bool,
    warned_spool_full: bool,
    /// Records the training side could not hand over (a full queue).
    queue_dropped: Arc<AtomicU64>,
    deadline: Arc<std::sync::Mutex<Option<Instant>>>,
}

const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How often an idle worker looks at the queue and the spool: a record waits at
/// most this long to be seen, on top of `batch_interval`.
const IDLE_WAKE: Duration = Duration::from_millis(200);

impl Worker {
    fn run(mut self, rx: Receiver<StepRecord>) -> Summary {
        // Register before the first step arrives, so the server can check the
        // registration (and flag what it proves wrong) at once.
        self.ensure_registered();
        let batch_size = self.config.batch_size.max(1);
        let mut batch: Vec<StepRecord> = Vec::new();
        let mut batch_started = Instant::now();
        let mut next_attempt = Instant::now();
        let mut backoff = Duration::from_millis(200);
        loop {
            let open = loop {
                match rx.try_recv() {
                    Ok(record) => {
                        if batch.is_empty() {
                            batch_started = Instant::now();
                        }
                        batch.push(record);
                    }
                    Err(TryRecvError::Empty) => break true,
                    Err(TryRecvError::Disconnected) => break false,
                }
            };
            while batch.len() >= batch_size {
                let full: Vec<StepRecord> = batch.drain(..batch_size).collect();
                self.deliver(full);
                batch_started = Instant::now();
            }
            if !batch.is_empty() && batch_started.elapsed() >= self.config.batch_interval {
                self.deliver(std::mem::take(&mut batch));
            }
            if !open {
                break;
            }
            if !self.spool.is_empty() && Instant::now() >= next_attempt {
                if self.replay() {
                    backoff = Duration::from_millis(200);
                } else {
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    next_attempt = Instant::now() + jitter(backoff);
                }
            }
            let wait = if batch.is_empty() {
                IDLE_WAKE
            } else {
                self.config
                    .batch_interval
                    .saturating_sub(batch_started.elapsed())
            };
            std::thread::park_timeout(wait.max(Duration::from_millis(1)));
        }
        // Training is over: flush within the deadline.
        if !batch.is_empty() {
            self.deliver(batch);
        }
        let deadline = self
            .deadline
            .lock()
            .expect("deadline lock")
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(10));
        while !self.spool.is_empty() && Instant::now() < deadline {
            if !self.replay() {
                std::thread::sleep(
                    Duration::from_millis(250)
                        .min(deadline.saturating_duration_since(Instant::now())),
                );
            }
        }
        self.summary.undelivered = self.spool.records;
        if self.summary.undelivered > 0 {
            self.write_sidecar();
            self.summary.spool = Some(self.spool.path.clone());
        }
        self.summary.dropped = self.dropped_so_far();
        if self.spool.is_empty() && self.registered {
            self.announce_finished();
        }
        self.summary
    }

    /// Beside a spool left undelivered: the run id and registration that
    /// `gradflow-server import SPOOL` needs to load it later.
    fn write_sidecar(&self) {
        let mut name = self.spool.path.as_os_str().to_owned();
        name.push(".registration.json");
        let body = serde_json::json!({
            "run_id": self.config.run_id,
            "registration": &self.registration,
        });
        if let Err(error) = std::fs::write(&name, body.to_string()) {
            tracing::warn!(%error, path = ?name, "could not write the spool's registration");
        }
    }

    /// Tells the server the run is over (the dashboard then shows it finished, not
    /// stale). Best effort: a server that does not answer just sees a stale run.
    fn announce_finished(&mut self) {
        let request = self.request(reqwest::Method::POST, "/finish");
        match self.send(request) {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                tracing::warn!(status = %r.status(), "the server did not mark the run finished")
            }
            Err(error) => tracing::warn!(%error, "could not tell the server the run finished"),
        }
    }

    /// Sends a batch, or spools it behind what is already spooled.
    fn deliver(&mut self, batch: Vec<StepRecord>) {
        if self.summary.registration_error.is_some() {
            self.summary.dropped += batch.len() as u64;
            return;
        }
        if !self.spool.is_empty() || !self.ensure_registered() {
            self.spool_batch(&batch);
            return;
        }
        match self.post(&batch) {
            Ok(()) => {}
            Err(PostError::Unavailable(why)) => {
                self.warn_unreachable(&why);
                self.spool_batch(&batch);
            }
            Err(PostError::Unregistered) => {
                self.registered = false;
                self.spool_batch(&batch);
            }
            Err(PostError::Rejected(why)) => match self.salvage(&batch, why) {
                Ok(()) => {}
                Err((PostError::Unregistered, unsent)) => {
                    self.registered = false;
                    self.spool_batch(&batch[unsent..]);
                }
                Err((PostError::Unavailable(why) | PostError::Rejected(why), unsent)) => {
                    self.warn_unreachable(&why);
                    self.spool_batch(&batch[unsent..]);
                }
            },
        }
    }

    /// Delivers `records` after the server refused them as one batch (`why`): a
    /// batch is all or nothing, so one bad value would cost every good record with
    /// it. The halves are resent, recursively, until only the invalid records are
    /// left out; they alone are counted as rejected. On a server that stops
    /// answering meanwhile, says from which record on nothing was sent.
    fn salvage(&mut self, records: &[StepRecord], why: String) -> Result<(), (PostError, usize)> {
        if let [record] = records {
            tracing::error!(
                step = record.step,
                "the server rejected a step record: {why}"
            );
            self.summary.rejected += 1;
            return Ok(());
        }
        let (left, right) = records.split_at(records.len() / 2);
        for (offset, half) in [(0, left), (left.len(), right)] {
            match self.post(half) {
                Ok(()) => {}
                Err(PostError::Rejected(why)) => {
                    self.salvage(half, why).map_err(|(e, i)| (e, offset + i))?;
                }
                Err(other) => return Err((other, offset)),
            }
        }
        Ok(())
    }

    fn spool_batch(&mut self, batch: &[StepRecord]) {
        if let Err(error) = self.spool.append(batch) {
            tracing::error!(%error, "cannot write the spool file; steps are lost");
            self.summary.dropped += batch.len() as u64;
        }
        if self.spool.dropped > 0 && !self.warned_spool_full {
            tracing::warn!(
                spool = %self.config.spool_path.display(),
                max_bytes = self.config.spool_max_bytes,
                "the spool is full (--spool-max-bytes): new step records are dropped \
                 until the server is back; how many is told to the server and at exit"
            );
            self.warned_spool_full = true;
        }
    }

    /// Records of this run lost so far: queue full, spool full, or unwritable.
    fn dropped_so_far(&self) -> u64 {
        self.queue_dropped.load(Ordering::Relaxed) + self.spool.dropped + self.summary.dropped
    }

    /// Sends spooled batches in order; returns whether the spool emptied.
    fn replay(&mut self) -> bool {
        if !self.ensure_registered() {
            return false;
        }
        let records = match self.spool.read() {
            Ok(records) => records,
            Err(error) => {
                tracing::error!(%error, "cannot read the spool file");
                return false;
            }
        };
        let total = records.len();
        let mut sent = 0;
        for chunk in records.chunks(self.config.batch_size.max(1)) {
            match self.post(chunk) {
                Ok(()) => sent += chunk.len(),
                Err(PostError::Rejected(why)) => match self.salvage(chunk, why) {
                    Ok(()) => sent += chunk.len(),
                    Err((error, unsent)) => {
                        sent += unsent;
                        if matches!(error, PostError::Unregistered) {
                            self.registered = false;
                        }
                        break;
                    }
                },
                Err(PostError::Unregistered) => {
                    self.registered = false;
                    break;
                }
                Err(PostError::Unavailable(_)) => break,
            }
        }
        if let Err(error) = self.spool.keep_from(&records[sent..]) {
            tracing::error!(%error, "cannot rewrite the spool file");
        }
        if sent == total && total > 0 && self.warned {
            tracing::info!(
                steps = total,
                "the gradflow server is back: spooled steps delivered"
            );
            self.warned = false;
        }
        self.spool.is_empty()
    }

    /// Says once, until the spool is delivered, that no server takes the steps.
    fn warn_unreachable(&mut self, why: &str) {
        if self.warned {
            return;
        }
        let spool = self.config.spool_path.display();
        if self.servers.len() == 1 {
            tracing::warn!(
                server = %self.servers.current(),
                %spool,
                "gradflow server unreachable ({why}); training continues and steps are \
                 spooled until it is back"
            );
        } else {
            tracing::warn!(
                servers = %self.servers.list(),
                %spool,
                "every gradflow server unreachable (the last: {why}); training continues \
                 and steps are spooled until one is back"
            );
        }
        self.warned = true;
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        let url = format!(
            "{}/api/v1/runs/{}{path}",
            self.servers.current(),
            self.config.run_id
        );
        let mut request = self.client.request(method, url);
        if let Some(token) = &self.config.token {
            request = request.bearer_auth(token);
        }
        request
    }

    /// Sends `request` to the server in use; any answer but a 5xx counts as the
    /// server answering.
    fn send(
        &mut self,
        request: reqwest::blocking::RequestBuilder,
    ) -> reqwest::Result<reqwest::blocking::Response> {
        let response = request.send()?;
        if !response.status().is_server_error() {
            self.servers.answered();
        }
        Ok(response)
    }

    /// Registers once a server answers (trying each once); a conflicting
    /// registration is final.
    fn ensure_registered(&mut self) -> bool {
        if self.registered {
            return true;
        }
        if self.summary.registration_error.is_some() {
            return false;
        }
        let mut why = String::new();
        for tried in 0..self.servers.len() {
            if tried > 0 && !self.servers.advance() {
                break;
            }
            match self.register() {
                Ok(registered) => return registered,
                Err(unanswered) => why = unanswered,
            }
        }
        self.warn_unreachable(&why);
        false
    }

    /// One registration attempt on the server in use: why not, when it did not
    /// answer (the next server may).
    fn register(&mut self) -> Result<bool, String> {
        let request = self
            .request(reqwest::Method::PUT, "")
            .json(&self.registration);
        match self.send(request) {
            Ok(r) if r.status().is_success() => {
                self.registered = true;
                Ok(true)
            }
            Ok(r) if r.status().is_server_error() => Err(format!("HTTP {}", r.status())),
            Ok(r) => {
                let status = r.status();
                let text = r.text().unwrap_or_default();
                tracing::error!(%status, "the server refused the run's registration: {text}");
                self.summary.registration_error = Some(format!("HTTP {status}: {text}"));
                Ok(false)
            }
            Err(error) => Err(error.to_string()),
        }
    }

    /// POSTs records gzipped, retrying transient failures three times on each server
    /// in turn. Once records have been dropped, each one sent carries the count
    /// (`dropped_steps`).
    fn post(&mut self, records: &[StepRecord]) -> Result<(), PostError> {
        let dropped = self.dropped_so_far();
        let stamped: Vec<StepRecord>;
        let records = if dropped > 0 {
            stamped = records
                .iter()
                .cloned()
                .map(|mut r| {
                    r.dropped_steps = Some(dropped);
                    r
                })
                .collect();
            &stamped
        } else {
            records
        };
        match self.post_encoded(records) {
            Ok(result) => result,
            Err(CborRefused) => {
                tracing::info!(
                    "the server does not take CBOR (protocol before v1.6): sending JSON"
                );
                self.cbor = false;
                self.post_encoded(records).unwrap_or_else(|CborRefused| {
                    Err(PostError::Rejected("JSON refused with 415".into()))
                })
            }
        }
    }

    /// Encodes the batch as the worker sends it now and POSTs it, to each server in
    /// turn while they do not answer.
    fn post_encoded(
        &mut self,
        records: &[StepRecord],
    ) -> Result<Result<(), PostError>, CborRefused> {
        let (content_type, encoded) = if self.cbor {
            (
                gradflow_protocol::CBOR_CONTENT_TYPE,
                gradflow_protocol::to_cbor(records),
            )
        } else {
            match serde_json::to_vec(records) {
                Ok(json) => ("application/json", json),
                Err(e) => return Ok(Err(PostError::Rejected(e.to_string()))),
            }
        };
        let body = match self.gzip.encode(&encoded) {
            Ok(body) => body,
            Err(e) => return Ok(Err(PostError::Rejected(e.to_string()))),
        };
        let mut result = self.post_body(content_type, &body)?;
        for _ in 1..self.servers.len() {
            if !matches!(result, Err(PostError::Unavailable(_))) || !self.servers.advance() {
                break;
            }
            result = self.post_body(content_type, &body)?;
        }
        Ok(result)
    }

    /// POSTs a gzipped batch to the current server, retrying transient failures
    /// three times.
    fn post_body(
        &mut self,
        content_type: &str,
        body: &[u8],
    ) -> Result<Result<(), PostError>, CborRefused> {
        let mut delay = Duration::from_millis(100);
        let mut last = String::new();
        for attempt in 0..3 {
            if attempt > 0 {
                std::thread::sleep(jitter(delay));
                delay *= 2;
            }
            let request = self
                .request(reqwest::Method::POST, "/steps")
                .header("Content-Type", content_type)
                .header("Content-Encoding", "gzip")
                .body(body.to_vec());
            match self.send(request) {
                Ok(r) if r.status().is_success() => {
                    let outcome: serde_json::Value = r.json().unwrap_or_default();
                    self.summary.delivered += outcome["accepted"].as_u64().unwrap_or(0);
                    self.summary.duplicates += outcome["duplicates"].as_u64().unwrap_or(0);
                    let late = outcome["late"].as_u64().unwrap_or(0);
                    if late > 0 && self.summary.late == 0 {
                        // Once a run: the count is in the summary at exit.
                        tracing::warn!(
                            late,
                            "the server refused steps as late: another writer of this run \
                             moved it past them, so they are not stored"
                        );
                    }
                    self.summary.late += late;
                    return Ok(Ok(()));
                }
                Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                    return Ok(Err(PostError::Unregistered));
                }
                Ok(r) if r.status().is_server_error() => last = format!("HTTP {}", r.status()),
                Ok(r)
                    if r.status() == reqwest::StatusCode::UNSUPPORTED_MEDIA_TYPE
                        && content_type == gradflow_protocol::CBOR_CONTENT_TYPE =>
                {
                    return Err(CborRefused);
                }
                Ok(r) => {
                    let status = r.status();
                    return Ok(Err(PostError::Rejected(format!(
                        "HTTP {status}: {}",
                        r.text().unwrap_or_default()
                    ))));
                }
                Err(error) => last = error.to_string(),
            }
        }
        Ok(Err(PostError::Unavailable(last)))
    }
}

/// `delay` ± 25 %, so that many trainers that lost the same server do not come back
/// in lockstep.
fn jitter(delay: Duration) -> Duration {
    let factor = rand::thread_rng().gen_range(0.75..1.25);
    delay.mul_f64(factor)
}
