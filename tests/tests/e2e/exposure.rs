//! A server told to listen beyond loopback without its tokens says so, loudly, before
//! it serves (one warning per missing token); with both tokens, or on loopback, it
//! does not.

use gradflow_e2e::ServerProcess;

const INGEST_WARNING: &str = "LISTENING BEYOND LOOPBACK WITHOUT AN INGEST TOKEN";
const READ_WARNING: &str = "LISTENING BEYOND LOOPBACK WITHOUT A READ TOKEN";

fn warning<'a>(logs: &'a [String], text: &str) -> Option<&'a String> {
    logs.iter().find(|line| line.contains(text))
}

#[test]
fn the_server_says_where_its_dashboard_is_when_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("a.db"), &[]);
    let logs = server.logs();
    let line = warning(&logs, "gradflow-server listening")
        .unwrap_or_else(|| panic!("no start line in:\n{}", logs.join("\n")));
    let dashboard = format!("dashboard={}/", server.base);
    assert!(line.contains(&dashboard), "{dashboard} not in {line}");
}

#[test]
fn listening_beyond_loopback_without_a_token_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let open = ServerProcess::start_at(&dir.path().join("a.db"), "0.0.0.0:0", &[]);
    let logs = open.logs();
    for (text, flag) in [
        (INGEST_WARNING, "--ingest-token"),
        (READ_WARNING, "--read-token"),
    ] {
        let line =
            warning(&logs, text).unwrap_or_else(|| panic!("no {text:?} in:\n{}", logs.join("\n")));
        assert!(line.contains("WARN"), "{line}");
        assert!(line.contains(flag), "{line}");
    }
    drop(open);

    // Only the token that is missing is warned about.
    let write_guarded = ServerProcess::start_at(
        &dir.path().join("b.db"),
        "0.0.0.0:0",
        &["--ingest-token", "s3cret"],
    );
    let logs = write_guarded.logs();
    assert!(warning(&logs, INGEST_WARNING).is_none(), "{logs:?}");
    assert!(warning(&logs, READ_WARNING).is_some(), "{logs:?}");
    drop(write_guarded);

    let guarded = ServerProcess::start_at(
        &dir.path().join("c.db"),
        "0.0.0.0:0",
        &["--ingest-token", "s3cret", "--read-token", "r34d"],
    );
    let local = ServerProcess::start(&dir.path().join("d.db"), &[]);
    for server in [&guarded, &local] {
        let logs = server.logs();
        for text in [INGEST_WARNING, READ_WARNING] {
            assert!(warning(&logs, text).is_none(), "{text}: {logs:?}");
        }
    }
}
