//! A server told to listen beyond loopback without an ingest token says so, loudly,
//! before it serves; with a token, or on loopback, it does not.

use gradflow_e2e::ServerProcess;

const WARNING: &str = "LISTENING BEYOND LOOPBACK WITHOUT AN INGEST TOKEN";

#[test]
fn listening_beyond_loopback_without_a_token_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let open = ServerProcess::start_at(&dir.path().join("a.db"), "0.0.0.0:0", &[]);
    let logs = open.logs();
    let warning = logs
        .iter()
        .find(|line| line.contains(WARNING))
        .unwrap_or_else(|| panic!("no warning in:\n{}", logs.join("\n")));
    assert!(warning.contains("WARN"), "{warning}");
    assert!(warning.contains("--ingest-token"), "{warning}");
    drop(open);

    let guarded = ServerProcess::start_at(
        &dir.path().join("b.db"),
        "0.0.0.0:0",
        &["--ingest-token", "s3cret"],
    );
    let local = ServerProcess::start(&dir.path().join("c.db"), &[]);
    for server in [&guarded, &local] {
        assert!(
            !server.logs().iter().any(|line| line.contains(WARNING)),
            "{:?}",
            server.logs()
        );
    }
}
