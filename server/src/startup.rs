//! Wiring: opens the store, starts the event bus and the ingest service, binds the
//! listener, serves until told to stop.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::ServerConfig;
use crate::events::EventBus;
use crate::ingest::Ingest;
use crate::state::{ApiSettings, AppState};
use crate::store::Store;

/// A bound, ready server. Tests build one on `127.0.0.1:0` and read [`Application::address`].
pub struct Application {
    listener: TcpListener,
    state: AppState,
    retain_days: Option<u32>,
    webhooks: crate::webhooks::WebhookSettings,
    shutdown: tokio::sync::watch::Sender<bool>,
}

impl Application {
    pub async fn build(config: &ServerConfig) -> anyhow::Result<Application> {
        let store = Arc::new(Store::open(&config.store()?).await?);
        let listener = TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let address = listener.local_addr().context("reading the bound address")?;
        if !address.ip().is_loopback() {
            warn_if_open(address, config);
        }
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let events = EventBus::start(store.clone(), shutdown_rx.clone());
        let ingest = Arc::new(Ingest::new(store.clone(), events.clone(), config.ingest()));
        let state = AppState {
            shutdown: shutdown_rx,
            metrics: Arc::new(crate::metrics::Metrics::new()),
            store,
            ingest,
            events,
            settings: Arc::new(ApiSettings {
                ingest_token: config.ingest_token.clone(),
                read_token: config.read_token.clone(),
                cors_origins: config.cors_origins.clone(),
                max_body_bytes: config.max_body_bytes,
                request_timeout: std::time::Duration::from_secs(config.request_timeout_secs),
                max_concurrent_requests: config.max_concurrent_requests as usize,
            }),
            in_flight: Arc::new(tokio::sync::Semaphore::new(
                config.max_concurrent_requests as usize,
            )),
        };
        Ok(Application {
            listener,
            state,
            retain_days: config.retain_days,
            webhooks: config.webhooks.settings(),
            shutdown,
        })
    }

    /// Waits until the database answers and is migrated (PostgreSQL comes up in the
    /// background; SQLite is ready once built).
    pub async fn wait_ready(&self) {
        while self.state.store.ready().await.is_err() || !self.state.events.hearing() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    pub fn address(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves, lets requests in flight finish (so a batch
    /// being written is committed and answered), then closes the database.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Application {
            listener,
            state,
            retain_days,
            webhooks,
            shutdown: stop_streams,
        } = self;
        let store = state.store.clone();
        let waiting = tokio::spawn(crate::ingest::complete_waiting_steps(
            state.ingest.clone(),
            stop_streams.subscribe(),
        ));
        let retention = retain_days.map(|days| {
            tokio::spawn(crate::retention::run(
                store.clone(),
                days,
                stop_streams.subscribe(),
            ))
        });
        let sender = crate::webhooks::start(
            store.clone(),
            state.events.clone(),
            webhooks,
            stop_streams.subscribe(),
        )
        .await;
        let shutdown = async move {
            shutdown.await;
            let _ = stop_streams.send(true);
        };
        axum::serve(listener, crate::app::app(state))
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving HTTP")?;
        // Not waited for: a receiver that hangs must not hold the shutdown up. An
        // attempt cut short stays pending and is sent again after a restart.
        sender.stop().await;
        if let Some(retention) = retention {
            retention.abort();
        }
        waiting.abort();
        store.close().await
    }
}

/// Says loudly what anyone who can reach `address` may do without a token.
fn warn_if_open(address: SocketAddr, config: &ServerConfig) {
    if config.ingest_token.is_none() {
        tracing::warn!(
            %address,
            "LISTENING BEYOND LOOPBACK WITHOUT AN INGEST TOKEN: anyone who can reach \
             {address} can create, overwrite and delete runs. Set --ingest-token \
             (GRADFLOW_INGEST_TOKEN), or listen on 127.0.0.1"
        );
    }
    if config.read_token.is_none() {
        tracing::warn!(
            %address,
            "LISTENING BEYOND LOOPBACK WITHOUT A READ TOKEN: anyone who can reach \
             {address} can read every run and its registration. Set --read-token \
             (GRADFLOW_READ_TOKEN), or listen on 127.0.0.1"
        );
    }
}

/// Makes a write past the file-size limit (`ulimit -f`, RLIMIT_FSIZE) an error
/// instead of a kill. By default the kernel ends the process with SIGXFSZ; ignored,
/// the write fails with EFBIG, SQLite reports an I/O error, and the request gets
/// `503 storage_unavailable` like a full disk, leaving what was committed intact.
/// (PostgreSQL ignores SIGXFSZ for the same reason.)
pub fn survive_file_size_limit() {
    #[cfg(unix)]
    // SAFETY: installs the predefined SIG_IGN disposition for one signal at startup;
    // no handler code runs, so there is nothing to be async-signal-safe.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}
