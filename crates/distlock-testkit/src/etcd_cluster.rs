//! A real etcd cluster for tests: N members on free loopback ports, each with its data in
//! a private temporary directory, killed when the [`EtcdCluster`] is dropped.
//!
//! The harness talks to the members through etcd's own JSON gateway for the v3 API
//! (`POST /v3/kv/put`, `/v3/maintenance/status` on the client port), over plain HTTP/1.1
//! (see `etcd_gateway.rs`), so it needs neither a gRPC client nor `etcdctl`.
//!
//! Members are addressed by *index* (0..N, in start order), which never changes; the
//! leader does. Raft timing is etcd's default (heartbeat 100 ms, election timeout 1 s):
//! shorter timeouts elect a new leader sooner but also depose a healthy one when the
//! two-core test machine is busy.
//!
//! On this machine (2 cores, etcd 3.4.23) a 3-member cluster is ready (leader elected, a
//! write read back through every member) 0.4–2.6 s after the processes are spawned (the
//! first election waits out a randomized election timeout), a single member in 0.1–0.9 s.
//! A new leader is elected 1–2 s after the old one is killed, and a restarted member
//! serves again within 0.2 s.
//!
//! ```no_run
//! use distlock_testkit::{EtcdCluster, TestkitError};
//!
//! # async fn demo() -> Result<(), TestkitError> {
//! let mut cluster = EtcdCluster::start(3).await?;
//! let url = cluster.url(); // etcd://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3
//! let old = cluster.leader().await?;
//! cluster.kill(old).await?;
//! let new = cluster.leader().await?; // among the members still running
//! cluster.restart(old).await?;        // same data, same ports; back as a follower
//! # let _ = (url, new);
//! # Ok(())
//! # }
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use crate::error::TestkitError;
use crate::etcd_gateway::{get, put, status};
use crate::probe::{poll, POLL_INTERVAL};
use crate::store_process::{find_on_path, pick_free_ports, StoreProcess};

/// Environment variable naming the `etcd` binary to use instead of the one on `PATH`.
pub const ETCD_BIN_ENV: &str = "DISTLOCK_ETCD_BIN";

const STORE: &str = "etcd";
/// Bound on a cluster (or a restarted member) becoming ready, and on a leader election.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts tried on fresh ports when a member could not bind the ports it was given.
const START_ATTEMPTS: u32 = 3;
/// The key written and read back to prove the cluster serves requests.
const PROBE_KEY: &str = "distlock-testkit/ready";

/// One etcd process.
#[derive(Debug)]
struct Member {
    client_port: u16,
    /// etcd's member id, from its status; 0 until the cluster first became ready.
    id: u64,
    process: StoreProcess,
}

/// N etcd members forming one cluster on loopback.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    _dir: TempDir,
}

impl EtcdCluster {
    /// Starts `members` etcd processes (1 for a single-member cluster, 3 or 5 for a
    /// quorum) and waits until every member reports the same leader and a write through
    /// the first member reads back, linearizably, through every member.
    ///
    /// The binary is taken from `DISTLOCK_ETCD_BIN` if set, otherwise `etcd` from `PATH`
    /// (Debian's `etcd-server` package installs it).
    pub async fn start(members: usize) -> Result<EtcdCluster, TestkitError> {
        if members == 0 {
            return Err(TestkitError::Topology(
                "an etcd cluster needs at least one member".into(),
            ));
        }
        let binary = find_etcd()?;
        let dir = tempfile::Builder::new()
            .prefix("distlock-etcd-")
            .tempdir()
            .map_err(TestkitError::io("creating a directory for etcd"))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut started = spawn_members(&binary, dir.path(), members)?;
            match wait_ready(&mut started).await {
                Ok(()) => {
                    return Ok(EtcdCluster {
                        members: started,
                        _dir: dir,
                    })
                }
                Err(err) if attempt < START_ATTEMPTS && lost_a_port(&started) => {
                    tracing::warn!(error = %err, attempt, "etcd could not bind its ports; trying others");
                    for member in &mut started {
                        member.process.kill().await?;
                    }
                    clear_dir(dir.path())?;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// How many members the cluster has (running or not).
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// `127.0.0.1:PORT` of every member's client port, in index order.
    pub fn endpoints(&self) -> Vec<String> {
        self.client_ports()
            .into_iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect()
    }

    /// The client ports, in index order (stable across restarts).
    pub fn client_ports(&self) -> Vec<u16> {
        self.members
            .iter()
            .map(|member| member.client_port)
            .collect()
    }

    /// `etcd://127.0.0.1:p1,127.0.0.1:p2,…`: the whole cluster in one URL.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// etcd's id of member `index`.
    pub fn member_id(&self, index: usize) -> Result<u64, TestkitError> {
        Ok(self.member(index)?.id)
    }

    /// The process id of member `index`; `None` after [`kill`](Self::kill).
    pub fn pid(&self, index: usize) -> Option<u32> {
        self.members.get(index)?.process.pid()
    }

    /// The last lines (up to 60) member `index` wrote, oldest first.
    pub fn recent_log(&self, index: usize) -> Vec<String> {
        self.members
            .get(index)
            .map(|member| member.process.recent_log())
            .unwrap_or_default()
    }

    /// The index of the current leader: waits (up to 30 s) until every member that runs
    /// and is not frozen reports the same leader, and that leader is one of them. So right
    /// after the leader is killed or frozen this waits for the election of the next.
    pub async fn leader(&self) -> Result<usize, TestkitError> {
        let live = self.live_members();
        let members = &self.members;
        poll(
            "the etcd members to agree on a leader",
            READY_TIMEOUT,
            || {
                let live = &live;
                async move {
                    let mut seen = Vec::with_capacity(live.len());
                    for &index in live {
                        let status = status(members[index].client_port)
                            .await
                            .map_err(|err| format!("member {index}: {err}"))?;
                        seen.push(status.leader);
                    }
                    match seen.as_slice() {
                        [first, rest @ ..] if *first != 0 && rest.iter().all(|id| id == first) => {
                            live.iter()
                                .copied()
                                .find(|&index| members[index].id == *first)
                                .ok_or_else(|| format!("leader {first:x} is not a live member"))
                        }
                        _ => Err(format!("members {live:?} report leaders {seen:x?}")),
                    }
                }
            },
        )
        .await
    }

    /// Kills member `index` with SIGKILL and waits until it has exited. Its data stays
    /// for [`restart`](Self::restart).
    pub async fn kill(&mut self, index: usize) -> Result<(), TestkitError> {
        self.member_mut(index)?.process.kill().await
    }

    /// Freezes member `index` with SIGSTOP: its connections stay open but it answers
    /// nothing, like a process stalled in a pause or cut off by the network.
    pub fn stop(&self, index: usize) -> Result<(), TestkitError> {
        self.member(index)?.process.pause()
    }

    /// Continues member `index` after [`stop`](Self::stop) (SIGCONT).
    pub fn resume(&self, index: usize) -> Result<(), TestkitError> {
        self.member(index)?.process.resume()
    }

    /// Kills member `index` if it runs, starts it again on the same ports with the same
    /// data directory, and waits until it knows the leader and serves a linearizable read.
    pub async fn restart(&mut self, index: usize) -> Result<(), TestkitError> {
        let member = self.member_mut(index)?;
        member.process.restart().await?;
        wait_serving(member, READY_TIMEOUT).await
    }

    /// Writes `key` = `value` through member `index` (a follower forwards it to the
    /// leader).
    pub async fn put(&self, index: usize, key: &str, value: &str) -> Result<(), TestkitError> {
        put(self.member(index)?.client_port, key, value).await
    }

    /// Reads `key` through member `index`, linearizably; `None` if it is absent.
    pub async fn get(&self, index: usize, key: &str) -> Result<Option<String>, TestkitError> {
        get(self.member(index)?.client_port, key).await
    }

    fn live_members(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&index| self.members[index].process.is_live())
            .collect()
    }

    fn member(&self, index: usize) -> Result<&Member, TestkitError> {
        self.members.get(index).ok_or_else(|| no_member(index))
    }

    fn member_mut(&mut self, index: usize) -> Result<&mut Member, TestkitError> {
        self.members.get_mut(index).ok_or_else(|| no_member(index))
    }
}

fn no_member(index: usize) -> TestkitError {
    TestkitError::Topology(format!("the etcd cluster has no member {index}"))
}

fn find_etcd() -> Result<PathBuf, TestkitError> {
    if let Some(path) = std::env::var_os(ETCD_BIN_ENV).filter(|path| !path.is_empty()) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(TestkitError::StoreNotInstalled {
                store: STORE,
                hint: format!("${ETCD_BIN_ENV} names {}, which is no file", path.display()),
            })
        };
    }
    find_on_path("etcd").ok_or_else(|| TestkitError::StoreNotInstalled {
        store: STORE,
        hint: format!(
            "no etcd in ${ETCD_BIN_ENV} or PATH; install it with `apt-get install etcd-server`"
        ),
    })
}

/// Spawns every member of a new cluster on fresh ports, each in `dir/m<index>`.
fn spawn_members(binary: &Path, dir: &Path, count: usize) -> Result<Vec<Member>, TestkitError> {
    let ports = pick_free_ports(2 * count)?;
    let (client_ports, peer_ports) = ports.split_at(count);
    let initial_cluster: Vec<String> = peer_ports
        .iter()
        .enumerate()
        .map(|(index, port)| format!("m{index}=http://127.0.0.1:{port}"))
        .collect();
    let initial_cluster = initial_cluster.join(",");
    // Unique per cluster, so a member never joins another test's cluster whose ports it
    // happens to reuse.
    let token = dir
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "distlock-testkit".into());
    let mut members = Vec::with_capacity(count);
    for index in 0..count {
        let client = format!("http://127.0.0.1:{}", client_ports[index]);
        let peer = format!("http://127.0.0.1:{}", peer_ports[index]);
        let data = dir.join(format!("m{index}"));
        let mut args: Vec<OsString> = Vec::new();
        let mut flag = |name: &str, value: OsString| {
            args.push(format!("--{name}").into());
            args.push(value);
        };
        flag("name", format!("m{index}").into());
        flag("data-dir", data.into_os_string());
        flag("listen-client-urls", client.clone().into());
        flag("advertise-client-urls", client.into());
        flag("listen-peer-urls", peer.clone().into());
        flag("initial-advertise-peer-urls", peer.into());
        flag("initial-cluster", initial_cluster.clone().into());
        flag("initial-cluster-state", "new".into());
        flag("initial-cluster-token", token.clone().into());
        flag("logger", "zap".into());
        flag("log-outputs", "stderr".into());
        let process = StoreProcess::spawn(format!("etcd member {index}"), binary.into(), args)?;
        members.push(Member {
            client_port: client_ports[index],
            id: 0,
            process,
        });
    }
    Ok(members)
}

/// Waits until every member reports one leader and serves a write made through the
/// first; records each member's id. Fails at once if a member exits.
async fn wait_ready(members: &mut [Member]) -> Result<(), TestkitError> {
    let started = Instant::now();
    let deadline = started + READY_TIMEOUT;
    loop {
        if let Some((index, status)) = members
            .iter_mut()
            .enumerate()
            .find_map(|(index, member)| member.process.exited().map(|status| (index, status)))
        {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!("member {index} exited while starting ({status})"),
                output: members[index].process.log_text(),
            });
        }
        let last = match probe_ready(members).await {
            Ok(ids) => {
                for (member, id) in members.iter_mut().zip(ids) {
                    member.id = id;
                }
                return Ok(());
            }
            Err(state) => state,
        };
        if Instant::now() + POLL_INTERVAL >= deadline {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "the cluster was not ready after {:?}; last seen: {last}",
                    started.elapsed()
                ),
                output: all_logs(members),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// One readiness check: the member ids if the cluster is ready, else what was seen.
async fn probe_ready(members: &[Member]) -> Result<Vec<u64>, String> {
    let mut ids = Vec::with_capacity(members.len());
    let mut leaders = Vec::with_capacity(members.len());
    for (index, member) in members.iter().enumerate() {
        let status = status(member.client_port)
            .await
            .map_err(|err| format!("member {index}: {err}"))?;
        ids.push(status.member);
        leaders.push(status.leader);
    }
    match leaders.as_slice() {
        [first, rest @ ..] if *first != 0 && rest.iter().all(|id| id == first) => {}
        _ => return Err(format!("leaders reported: {leaders:x?}")),
    }
    let first = members.first().ok_or("no members")?;
    let stamp = format!("{:?}", Instant::now());
    put(first.client_port, PROBE_KEY, &stamp)
        .await
        .map_err(|err| format!("put through member 0: {err}"))?;
    for (index, member) in members.iter().enumerate() {
        match get(member.client_port, PROBE_KEY).await {
            Ok(Some(value)) if value == stamp => {}
            other => return Err(format!("member {index} read {other:?}")),
        }
    }
    Ok(ids)
}

/// Waits until a (re)started member knows a leader and serves a linearizable read, which
/// needs the leader's commit index.
async fn wait_serving(member: &mut Member, limit: Duration) -> Result<(), TestkitError> {
    let started = Instant::now();
    loop {
        if let Some(status) = member.process.exited() {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "{} exited after a restart ({status})",
                    member.process.label()
                ),
                output: member.process.log_text(),
            });
        }
        let port = member.client_port;
        let check = async {
            let status = status(port).await.map_err(|err| err.to_string())?;
            if status.leader == 0 {
                return Err("no leader known yet".to_owned());
            }
            get(port, PROBE_KEY)
                .await
                .map(drop)
                .map_err(|err| err.to_string())
        };
        let Err(last) = check.await else {
            return Ok(());
        };
        if started.elapsed() + POLL_INTERVAL >= limit {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "{} did not serve again within {limit:?}; last seen: {last}",
                    member.process.label()
                ),
                output: member.process.log_text(),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Whether a member ended because a port was taken between picking it and binding it.
fn lost_a_port(members: &[Member]) -> bool {
    members
        .iter()
        .any(|member| member.process.log_text().contains("address already in use"))
}

fn all_logs(members: &[Member]) -> String {
    members
        .iter()
        .map(|member| {
            format!(
                "--- {}:\n{}",
                member.process.label(),
                member.process.log_text()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Empties `dir` for another start.
fn clear_dir(dir: &Path) -> Result<(), TestkitError> {
    for entry in std::fs::read_dir(dir).map_err(TestkitError::io("listing etcd's directory"))? {
        let path = entry
            .map_err(TestkitError::io("listing etcd's directory"))?
            .path();
        std::fs::remove_dir_all(&path)
            .map_err(TestkitError::io(format!("removing {}", path.display())))?;
    }
    Ok(())
}
