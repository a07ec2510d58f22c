//! The compose files stay honest: every `GRADFLOW_*` variable a service sets is one
//! the binary it runs reads (it appears in that binary's `--help`), so a renamed flag
//! cannot leave a compose setting silently ignored. (Their schema and the
//! Dockerfiles are checked by `scripts/check-containers.sh` in CI.)

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use gradflow_e2e::binary;

/// `GRADFLOW_*` keys under each service's `environment:` map, by service name. A
/// small reader for the layout of our own compose files (two-space indentation,
/// `environment` as a map), which the test asserts as it goes.
fn environment_by_service(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut in_services = false;
    let mut service: Option<String> = None;
    let mut in_environment = false;
    for line in text.lines() {
        let content = line.trim_end();
        if content.trim_start().starts_with('#') || content.trim().is_empty() {
            continue;
        }
        let indent = content.len() - content.trim_start().len();
        let key = content.trim_start();
        match indent {
            0 => {
                in_services = key == "services:";
                service = None;
            }
            2 if in_services => {
                service = Some(key.trim_end_matches(':').to_owned());
                in_environment = false;
            }
            4 => in_environment = key == "environment:",
            6 if in_environment => {
                assert!(
                    !key.starts_with('-'),
                    "write environment as a map: {content}"
                );
                let name = key.split(':').next().unwrap_or_default();
                if name.starts_with("GRADFLOW_") {
                    let service = service.clone().expect("an environment inside a service");
                    found.entry(service).or_default().push(name.to_owned());
                }
            }
            _ => {}
        }
    }
    found
}

#[test]
fn every_gradflow_variable_in_compose_is_read_by_its_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let help = |name: &str| {
        let output = Command::new(binary(name)).arg("--help").output().unwrap();
        assert!(output.status.success());
        // clap wraps long lines: compare with the whitespace collapsed.
        let text = String::from_utf8(output.stdout).unwrap();
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    let (server_help, trainer_help) = (help("gradflow-server"), help("gradflow-trainer"));
    // The binary a service runs, by its name: `server`, or a replica `server-a`, …
    let help_of = |service: &str| match service {
        "trainer" => Some(&trainer_help),
        "server" => Some(&server_help),
        _ if service.starts_with("server-") => Some(&server_help),
        _ => None,
    };
    let files = [
        ("docker-compose.yml", &["server", "trainer"][..]),
        ("docker-compose.cpu.yml", &["trainer"][..]),
        (
            "docker-compose.postgres.yml",
            &["server-a", "server-b", "trainer"][..],
        ),
    ];
    for (file, services) in files {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let found = environment_by_service(&text);
        assert_eq!(
            found.keys().map(String::as_str).collect::<Vec<_>>(),
            services,
            "{file}: the services whose GRADFLOW_* settings were found"
        );
        for (service, variables) in found {
            let help =
                help_of(&service).unwrap_or_else(|| panic!("{file}: unexpected service {service}"));
            for variable in variables {
                // `[env: NAME=value]`, or `[env: NAME]` for a hidden value.
                assert!(
                    help.contains(&format!("env: {variable}="))
                        || help.contains(&format!("env: {variable}]")),
                    "{file}: service {service} sets {variable}, which its binary does not read"
                );
            }
        }
    }
}

#[test]
fn the_reader_finds_variables_by_service() {
    let text = "services:\n  server:\n    environment:\n      GRADFLOW_DB: x\n  trainer:\n    \
                image: t\n    environment:\n      GRADFLOW_STEPS: 3\n      OTHER: 1\n\
                volumes:\n  data:\n";
    let found = environment_by_service(text);
    assert_eq!(found["server"], ["GRADFLOW_DB"]);
    assert_eq!(found["trainer"], ["GRADFLOW_STEPS"]);
}
