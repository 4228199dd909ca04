//! A private PostgreSQL cluster for tests: `initdb` into a temporary directory, then a
//! `postgres` process on a free loopback port, stopped when dropped.
//!
//! PostgreSQL refuses to run as root, so when the tests run as root the cluster is created
//! and run as the `postgres` system user that the Debian package installs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::{Pid, User};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, Command};

use crate::error::TestkitError;
use crate::redis_server::pick_free_port;

/// Environment variable naming the directory of PostgreSQL's binaries.
pub const PG_BIN_ENV: &str = "DISTLOCK_PG_BIN";

const READY_MARKER: &str = "database system is ready to accept connections";
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running private PostgreSQL cluster with trust authentication on loopback.
pub struct PostgresServer {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl std::fmt::Debug for PostgresServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresServer")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl PostgresServer {
    /// Creates a cluster and starts it. Durability is off (`fsync=off`): the data is
    /// thrown away with the directory anyway.
    pub async fn start() -> Result<PostgresServer, TestkitError> {
        let bin = find_binaries()?;
        let dir = tempfile::Builder::new()
            .prefix("distlock-pg-")
            .tempdir()
            .map_err(TestkitError::io("creating a directory for PostgreSQL"))?;
        let owner = run_as()?;
        if let Some(user) = &owner {
            nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).map_err(|err| {
                TestkitError::Postgres {
                    what: format!("chown of {} to postgres", dir.path().display()),
                    output: err.to_string(),
                }
            })?;
        }
        let data = dir.path().join("data");
        let initdb = command(&bin.join("initdb"), owner.as_ref())
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .output()
            .await
            .map_err(TestkitError::io("running initdb"))?;
        if !initdb.status.success() {
            return Err(TestkitError::Postgres {
                what: format!("initdb failed ({})", initdb.status),
                output: String::from_utf8_lossy(&initdb.stderr).into_owned(),
            });
        }
        // The port is free when picked but may be taken before postgres binds it (another
        // test starting a server at the same moment): then try another.
        let mut attempt = 0;
        let (port, child, mut lines) = loop {
            attempt += 1;
            match launch(&bin, owner.as_ref(), &data, dir.path()).await {
                Ok(started) => break started,
                Err(err) if attempt < LAUNCH_ATTEMPTS => {
                    tracing::warn!(error = %err, attempt, "postgres did not start; trying another port");
                }
                Err(err) => return Err(err),
            }
        };
        // Keep reading so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(PostgresServer {
            port,
            child,
            _dir: dir,
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // SIGQUIT is PostgreSQL's immediate shutdown: the postmaster takes its backends
        // and shared memory down with it, where SIGKILL would leave them behind.
        if let Some(pid) = self.child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGQUIT);
        }
    }
}

/// How many ports `start` tries before it gives up.
const LAUNCH_ATTEMPTS: u32 = 3;

type Launched = (u16, Child, Lines<BufReader<ChildStderr>>);

/// Starts postgres on a free port and waits until it accepts connections.
async fn launch(
    bin: &Path,
    owner: Option<&User>,
    data: &Path,
    socket_dir: &Path,
) -> Result<Launched, TestkitError> {
    let port = pick_free_port()?;
    let mut child = command(&bin.join("postgres"), owner)
        .arg("-D")
        .arg(data)
        .args(["-p", &port.to_string(), "-k"])
        .arg(socket_dir)
        .args([
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(TestkitError::io("starting postgres"))?;
    let stderr = child.stderr.take().ok_or_else(|| TestkitError::Postgres {
        what: "no stderr pipe".into(),
        output: String::new(),
    })?;
    let mut lines = BufReader::new(stderr).lines();
    let mut output = Vec::new();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains(READY_MARKER);
            output.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await;
    if ready != Ok(true) {
        // Gone before the next attempt reuses the data directory.
        let _ = child.kill().await;
        return Err(TestkitError::Postgres {
            what: format!("postgres on port {port} did not become ready"),
            output: output.join("\n"),
        });
    }
    Ok((port, child, lines))
}

fn command(binary: &Path, owner: Option<&User>) -> Command {
    let mut command = Command::new(binary);
    if let Some(user) = owner {
        command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    }
    command
}

/// The `postgres` user when running as root, since PostgreSQL will not run as root.
fn run_as() -> Result<Option<User>, TestkitError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    match User::from_name("postgres") {
        Ok(Some(user)) => Ok(Some(user)),
        _ => Err(TestkitError::Postgres {
            what: "running as root, and there is no `postgres` user to run PostgreSQL as".into(),
            output: String::new(),
        }),
    }
}

fn find_binaries() -> Result<PathBuf, TestkitError> {
    if let Some(dir) = std::env::var_os(PG_BIN_ENV).filter(|dir| !dir.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    // Debian keeps the server binaries out of PATH, one directory per major version.
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("postgres").exists())
        .collect();
    versions.sort_by_key(|bin| {
        bin.parent()
            .and_then(|dir| dir.file_name())
            .and_then(|name| name.to_str())
            .and_then(|name| name.parse::<u32>().ok())
            .unwrap_or(0)
    });
    if let Some(bin) = versions.pop() {
        return Ok(bin);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .find(|dir| dir.join("initdb").exists() && dir.join("postgres").exists())
        .ok_or(TestkitError::PostgresNotInstalled)
}
