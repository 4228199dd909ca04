//! The `distlock` command: run a command under a lock on Redis, the way ops teams use
//! `flock`, `etcdctl lock` and `consul lock`, with a fencing token for the command and a
//! stop when the lock is lost. See docs/cli.md.
//!
//! - [`args`]: the command line;
//! - [`connect`]: the password's sources, and the connection;
//! - [`held`]: what is held (a lock, a fair lock, a permit) behind one face;
//! - [`child`]: the command's process group, signals, and stopping it;
//! - [`mark`]: the mark that keeps the next holder's command from starting early;
//! - [`holder`]: who holds a lock (host, pid, command, start), kept beside it;
//! - [`run`]: `run` and `elect`;
//! - [`inspect`]: `status`, `list`, `force-unlock`;
//! - [`exit`]: the exit codes;
//! - [`out`]: output that never panics on a closed pipe.

mod args;
mod child;
mod connect;
mod exit;
mod held;
mod holder;
mod inspect;
mod mark;
mod out;
mod run;
mod shape;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};

use args::{Cli, Command};
use exit::Failure;

/// How long the client's shutdown may take once the command is done.
const SHUTDOWN_LIMIT: Duration = Duration::from_millis(500);

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    if let Err(conflict) = args::settle(&matches, &mut cli) {
        return Failure::new(exit::USAGE, format!("error: {conflict}")).report();
    }
    let mut url_source = matches.value_source("url");
    // DISTLOCK_URL, like every DISTLOCK_* variable, is below the command line; above
    // REDIS_URL, which other tools read too. One that is set but not UTF-8 is refused,
    // never skipped: skipping it would take the lock on another Redis than the one named.
    if url_source != Some(clap::parser::ValueSource::CommandLine) {
        match url_from_environment() {
            Ok(Some(url)) => {
                cli.connection.url = url;
                url_source = Some(clap::parser::ValueSource::EnvVariable);
            }
            Ok(None) => {}
            Err(failure) => return failure.report(),
        }
    }
    out::set_verbose(cli.connection.verbose);
    // One thread: the command is spawned from it, so its parent-death signal is tied to
    // this process. The library runs its own background work on a thread of its own.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return Failure::new(exit::INTERNAL, format!("cannot start: {err}")).report(),
    };
    let outcome = runtime.block_on(async {
        let ttl = match &cli.command {
            Command::Run(args) => Some(args.hold.ttl),
            Command::Elect(args) => Some(args.hold.ttl),
            Command::Hold(args) => Some(args.hold.ttl),
            _ => None,
        };
        // Looking at locks and deleting one must work on a server that may evict keys,
        // to clean up; taking one must not.
        let allow_eviction = matches!(
            &cli.command,
            Command::Status(_) | Command::List(_) | Command::ForceUnlock(_) | Command::Fence(_)
        );
        let connect =
            async || connect::connect(&cli.connection, url_source, ttl, allow_eviction).await;
        let client = match &cli.command {
            Command::Elect(_) => match run::connect_for_elect(connect).await? {
                Ok(client) => client,
                Err(code) => return Ok(code),
            },
            _ => connect().await?,
        };
        let code = match &cli.command {
            Command::Run(args) => {
                run::run(
                    &client,
                    &args.hold,
                    Some(args.program.argv()),
                    &args.waiting,
                )
                .await
            }
            Command::Hold(args) => run::run(&client, &args.hold, None, &args.waiting).await,
            Command::Elect(args) => run::elect(&client, args).await,
            Command::Status(args) => inspect::status(&client, args).await,
            Command::Fence(args) => inspect::fence(&client, args).await,
            Command::List(args) => inspect::list(&client, args).await,
            Command::ForceUnlock(args) => inspect::force_unlock(&client, args).await,
        };
        // Every release was awaited above; what a shutdown could still wait for is a
        // Redis that is gone (after a lost lock), and the exit must not wait on it.
        let _ = tokio::time::timeout(SHUTDOWN_LIMIT, client.shutdown()).await;
        // Not dropped: its drop would wait for that Redis again, and the process exits
        // right after this.
        std::mem::forget(client);
        code
    });
    let code = match outcome {
        Ok(code) => code,
        Err(failure) => {
            out::say(&failure.message);
            failure.code
        }
    };
    let _ = std::io::stdout().flush();
    std::process::exit(i32::from(code))
}

/// The URL DISTLOCK_URL names, or else REDIS_URL (which clap reads for `--url`, and is
/// checked here too, as clap may skip a value that is not UTF-8); `None` when neither is
/// set. A variable that is set but is not UTF-8 is a usage error (2).
fn url_from_environment() -> Result<Option<String>, Failure> {
    for variable in ["DISTLOCK_URL", "REDIS_URL"] {
        let Some(url) = std::env::var_os(variable) else {
            continue;
        };
        return match url.into_string() {
            Ok(url) if variable == "DISTLOCK_URL" => Ok(Some(url)),
            // REDIS_URL is --url's own variable: clap has read it already.
            Ok(_) => Ok(None),
            Err(_) => Err(Failure::new(
                exit::USAGE,
                format!(
                    "{variable} is not valid UTF-8; a Redis URL must be (percent-encode a \
                     password's other bytes, or give it in --password-file)"
                ),
            )),
        };
    }
    Ok(None)
}
