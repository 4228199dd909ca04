//! The URLs that name a deployment, parsed before anything is connected:
//!
//! - `redis://host:port/db` or `rediss://…`: one server. If that server turns out to be a
//!   cluster node, the client switches to cluster mode with it as the seed, so pointing
//!   an existing configuration at a cluster just works.
//! - `redis+cluster://host1:port1,host2:port2/` (or `rediss+cluster://`): a cluster,
//!   given by seed nodes; any reachable one is enough to learn the topology.
//! - `redis+sentinel://host1:26379,host2:26379/mymaster[/db]` (or `rediss+sentinel://`):
//!   the master that the sentinels name, followed through failovers. Credentials in the
//!   URL are the data nodes'; sentinels that need their own take `sentinel_username` and
//!   `sentinel_password` query parameters.
//!
//! Whatever echoes a URL back in an error masks its password and shortens it here.

use crate::error::{Error, Result};

/// A deployment, as a URL names it, before anything is connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// One server (which may still turn out to be a cluster node).
    Single(String),
    /// Seed nodes of a cluster, each as a `redis://` or `rediss://` URL.
    Cluster(Vec<String>),
    /// The master a set of sentinels names.
    Sentinel(SentinelSpec),
    /// A PostgreSQL database (`postgres://` or `postgresql://`), as the URL gives it: its
    /// driver parses the rest. Parsed whether or not the `postgres` feature is built, so
    /// a build without it can say which feature the URL needs.
    Postgres(String),
    /// An etcd cluster: `etcd://[user:password@]host1:port1,host2:port2[/prefix]`.
    Etcd(EtcdSpec),
    /// A ZooKeeper ensemble: `zk://host1:port1,host2:port2[/prefix]`.
    Zk(ZkSpec),
}

/// Where a ZooKeeper URL points, parsed whether or not the `zk` feature is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZkSpec {
    /// `host:port` for each server.
    pub(crate) hosts: Vec<String>,
    /// The node every lock's node lives under: the URL's path without a trailing `/`, or
    /// `/distlock` when the URL gives none (or only `/`: the root is ZooKeeper's own).
    pub(crate) prefix: String,
}

/// Where an etcd URL points, parsed whether or not the `etcd` feature is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EtcdSpec {
    /// `http://host:port` for each endpoint.
    pub(crate) endpoints: Vec<String>,
    /// Every key distlock writes starts with it: the URL's path with a trailing `/`, or
    /// `distlock/` when the URL gives none.
    pub(crate) prefix: String,
    pub(crate) user: Option<(String, String)>,
}

/// Where to find a Sentinel-managed master, and how to talk to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelSpec {
    /// Each sentinel as a `redis://host:port` (or `rediss://`) URL, with its credentials.
    pub(crate) sentinels: Vec<String>,
    /// The master's name in the sentinels' configuration.
    pub(crate) service: String,
    pub(crate) db: i64,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) tls: bool,
}

/// Parses a connection URL into the deployment it names. Credentials and the database
/// path given once apply to every host of a multi-host URL.
pub(crate) fn parse_endpoint(url: &str) -> Result<Endpoint> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: mask_password(url),
        reason: reason.to_owned(),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(invalid("expected a scheme such as redis://"));
    };
    let node_scheme = match scheme {
        "redis" | "rediss" | "unix" | "redis+unix" => return Ok(Endpoint::Single(url.to_owned())),
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        "redis+sentinel" | "rediss+sentinel" => return parse_sentinel(url, scheme, rest),
        "postgres" | "postgresql" => return Ok(Endpoint::Postgres(url.to_owned())),
        "etcd" => return parse_etcd(url, rest),
        "zk" | "zookeeper" => return parse_zk(url, rest),
        _ => {
            return Err(invalid(
                "unsupported scheme; use redis://, rediss://, redis+cluster://, \
                 redis+sentinel:// (or their rediss+ forms), postgres://, etcd:// or zk://",
            ))
        }
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let seeds: Vec<String> = hosts
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() {
                return Err(invalid("a host in the list is empty"));
            }
            Ok(match userinfo {
                Some(userinfo) => format!("{node_scheme}://{userinfo}@{host}{path}"),
                None => format!("{node_scheme}://{host}{path}"),
            })
        })
        .collect::<Result<_>>()?;
    Ok(Endpoint::Cluster(seeds))
}

/// `etcd://[user:password@]host1:port1,host2:port2[/prefix]`.
fn parse_etcd(url: &str, rest: &str) -> Result<Endpoint> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: mask_password(url),
        reason: reason.to_owned(),
    };
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let user = match userinfo {
        None => None,
        Some(userinfo) => {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let decode = |text: &str| {
                percent_decode(text).ok_or_else(|| invalid("bad percent-encoding in the user info"))
            };
            Some((decode(user)?, decode(password)?))
        }
    };
    let endpoints = hosts
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() || host.contains(['?', '#', ' ']) {
                return Err(invalid("a host in the list is empty or malformed"));
            }
            Ok(format!("http://{host}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let prefix = path.trim_start_matches('/');
    let prefix = if prefix.is_empty() {
        "distlock/".to_owned()
    } else if prefix.ends_with('/') {
        prefix.to_owned()
    } else {
        format!("{prefix}/")
    };
    Ok(Endpoint::Etcd(EtcdSpec {
        endpoints,
        prefix,
        user,
    }))
}

/// `zk://host1:port1,host2:port2[/prefix]`. Credentials are refused rather than ignored:
/// the store does not authenticate yet, and a URL with them must not pass for protected.
fn parse_zk(url: &str, rest: &str) -> Result<Endpoint> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: mask_password(url),
        reason: reason.to_owned(),
    };
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(invalid(
            "credentials in a zk:// URL are not supported (ZooKeeper authentication is not \
             implemented yet)",
        ));
    }
    if path.contains(['?', '#']) {
        return Err(invalid("a zk:// URL takes no query or fragment"));
    }
    let hosts = authority
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() || host.contains([' ', '?', '#']) {
                return Err(invalid("a host in the list is empty or malformed"));
            }
            Ok(if host.contains(':') {
                host.to_owned()
            } else {
                format!("{host}:2181")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let trimmed = path.trim_end_matches('/');
    let prefix = if trimmed.is_empty() {
        "/distlock".to_owned()
    } else {
        trimmed.to_owned()
    };
    // ZooKeeper's own rules for a path: no empty, `.` or `..` element, no control
    // character.
    let bad_element = prefix
        .split('/')
        .skip(1)
        .any(|element| element.is_empty() || element == "." || element == "..");
    if bad_element || prefix.chars().any(char::is_control) {
        return Err(invalid(
            "the prefix must be a ZooKeeper path: no empty, `.` or `..` element and no \
             control character",
        ));
    }
    if prefix == "/zookeeper" || prefix.starts_with("/zookeeper/") {
        return Err(invalid(
            "the prefix must not be under /zookeeper, ZooKeeper's own node",
        ));
    }
    Ok(Endpoint::Zk(ZkSpec { hosts, prefix }))
}

/// `text` with its `%XX` escapes decoded; `None` if one is malformed or the result is not
/// UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            let hex = tail.get(..2)?;
            let value = u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
            bytes.push(value);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// `redis+sentinel://[user:password@]host1:port1,host2:port2/service[/db][?query]`.
fn parse_sentinel(url: &str, scheme: &str, rest: &str) -> Result<Endpoint> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: mask_password(url),
        reason: reason.to_owned(),
    };
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, query),
        None => (rest, ""),
    };
    let Some((authority, path)) = rest.split_once('/') else {
        return Err(invalid("the master's name is missing: …/mymaster"));
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    // The data nodes' credentials are decoded by redis-rs's own URL parser, so that a
    // percent-encoded password means here what it means in a redis:// URL.
    let (username, password) = match userinfo {
        None => (None, None),
        Some(userinfo) => {
            let info = redis::IntoConnectionInfo::into_connection_info(
                format!("redis://{userinfo}@localhost").as_str(),
            )
            .map_err(|_| invalid("the credentials before @ do not parse"))?;
            let settings = info.redis_settings();
            (
                settings.username().map(str::to_owned),
                settings.password().map(str::to_owned),
            )
        }
    };
    let mut segments = path.split('/').filter(|segment| !segment.is_empty());
    let service = segments
        .next()
        .ok_or_else(|| invalid("the master's name is missing: …/mymaster"))?
        .to_owned();
    let db = match segments.next() {
        Some(db) => db
            .parse()
            .map_err(|_| invalid("the database after the master's name must be a number"))?,
        None => 0,
    };
    let (mut sentinel_user, mut sentinel_password) = (None, None);
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        match pair.split_once('=') {
            Some(("sentinel_username", value)) => sentinel_user = Some(value.to_owned()),
            Some(("sentinel_password", value)) => sentinel_password = Some(value.to_owned()),
            _ => {
                return Err(invalid(
                    "unknown query parameter; only sentinel_username and sentinel_password",
                ))
            }
        }
    }
    let node_scheme = if scheme == "rediss+sentinel" {
        "rediss"
    } else {
        "redis"
    };
    let sentinel_userinfo = match (sentinel_user, sentinel_password) {
        (Some(user), Some(password)) => format!("{user}:{password}@"),
        (None, Some(password)) => format!(":{password}@"),
        (Some(user), None) => format!("{user}@"),
        (None, None) => String::new(),
    };
    let sentinels = hosts
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() {
                return Err(invalid("a sentinel in the list is empty"));
            }
            let sentinel = format!("{node_scheme}://{sentinel_userinfo}{host}");
            // Checked here, so a bad port is reported as a bad URL, not as a failure to
            // connect.
            redis::IntoConnectionInfo::into_connection_info(sentinel.as_str())
                .map_err(|err| invalid(&format!("sentinel {host:?}: {err}")))?;
            Ok(sentinel)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Endpoint::Sentinel(SentinelSpec {
        sentinels,
        service,
        db,
        username,
        password,
        tls: node_scheme == "rediss",
    }))
}

/// Longest URL echoed back in an error; the rest is cut, so a huge input does not make
/// a huge error message.
const MAX_ECHOED_URL: usize = 200;

/// Hides the password of a URL that is echoed back in an error, and shortens it.
pub(crate) fn mask_password(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((url, query)) => (url, Some(query)),
        None => (url, None),
    };
    let mut masked = match url.split_once("://") {
        None => url.to_owned(),
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => format!("{scheme}://***@{host}"),
            },
            None => url.to_owned(),
        },
    };
    if let Some(query) = query {
        // Query parameters may carry passwords too (`sentinel_password=`, redis-rs's
        // `password=`): any parameter whose name mentions one is masked.
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("pass") => {
                    format!("{name}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        masked.push('?');
        masked.push_str(&pairs.join("&"));
    }
    shorten_for_errors(masked)
}

/// Cuts text that came from the user (a URL, a master's name) to what an error message
/// may carry, so a huge input does not make a huge error.
pub(crate) fn shorten_for_errors(text: String) -> String {
    if text.chars().count() <= MAX_ECHOED_URL {
        return text;
    }
    let mut short: String = text.chars().take(MAX_ECHOED_URL).collect();
    short.push('…');
    short
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_and_cluster_urls() -> Result<()> {
        assert_eq!(
            parse_endpoint("redis://127.0.0.1:6379/0")?,
            Endpoint::Single("redis://127.0.0.1:6379/0".into())
        );
        assert_eq!(
            parse_endpoint("redis+cluster://app:pw@h1:7000,h2:7001/")?,
            Endpoint::Cluster(vec![
                "redis://app:pw@h1:7000/".into(),
                "redis://app:pw@h2:7001/".into()
            ])
        );
        assert_eq!(
            parse_endpoint("rediss+cluster://h1:7000")?,
            Endpoint::Cluster(vec!["rediss://h1:7000".into()])
        );
        Ok(())
    }

    #[test]
    fn parses_sentinel_urls() -> Result<()> {
        let Endpoint::Sentinel(spec) =
            parse_endpoint("redis+sentinel://app:pw@h1:26379,h2:26380/mymaster/2")?
        else {
            panic!("not a sentinel endpoint");
        };
        assert_eq!(spec.sentinels, ["redis://h1:26379", "redis://h2:26380"]);
        assert_eq!(spec.service, "mymaster");
        assert_eq!(spec.db, 2);
        assert_eq!(spec.username.as_deref(), Some("app"));
        assert_eq!(spec.password.as_deref(), Some("pw"));
        assert!(!spec.tls);
        // Credentials are percent-decoded, as in a redis:// URL.
        let Endpoint::Sentinel(spec) =
            parse_endpoint("redis+sentinel://:p%40ss%2Fw@h1:26379/mymaster")?
        else {
            panic!("not a sentinel endpoint");
        };
        assert_eq!(spec.password.as_deref(), Some("p@ss/w"));
        assert_eq!(spec.username, None);
        // redis-rs parses a rediss:// address only when built with TLS.
        #[cfg(feature = "tls")]
        {
            let Endpoint::Sentinel(spec) =
                parse_endpoint("rediss+sentinel://h1:26379/m?sentinel_password=s3")?
            else {
                panic!("not a sentinel endpoint");
            };
            assert_eq!(spec.sentinels, ["rediss://:s3@h1:26379"]);
            assert!(spec.tls && spec.password.is_none());
        }
        for bad in [
            "redis+sentinel://h1:26379",
            "redis+sentinel://h1:26379/",
            "redis+sentinel://h1:26379/m/x",
            "redis+sentinel://h1:26379/m?foo=1",
            "redis+sentinel://,h2:1/m",
            "redis+sentinel://h:99999/m",
        ] {
            assert!(
                matches!(parse_endpoint(bad), Err(Error::InvalidUrl { .. })),
                "{bad}"
            );
        }
        Ok(())
    }

    #[test]
    fn parses_zookeeper_urls() -> Result<()> {
        let Endpoint::Zk(spec) = parse_endpoint("zk://h1:2181,h2/locks/app/")? else {
            panic!("not a ZooKeeper endpoint");
        };
        assert_eq!(spec.hosts, ["h1:2181", "h2:2181"]);
        assert_eq!(spec.prefix, "/locks/app");
        for (url, prefix) in [("zk://h1", "/distlock"), ("zk://h1/", "/distlock")] {
            let Endpoint::Zk(spec) = parse_endpoint(url)? else {
                panic!("not a ZooKeeper endpoint");
            };
            assert_eq!(spec.prefix, prefix);
        }
        for bad in [
            "zk://",
            "zk://h1,,h2",
            "zk://u:secret@h1",
            "zk://h1/a//b",
            "zk://h1/a/../b",
            "zk://h1/zookeeper",
            "zk://h1/a?x=1",
        ] {
            match parse_endpoint(bad) {
                Err(Error::InvalidUrl { url, .. }) => assert!(!url.contains("secret"), "{url}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_bad_urls_without_echoing_passwords() {
        for url in [
            "http://h:1",
            "h:1",
            "redis+cluster://h1:1,,h2:2",
            "redis+cluster://u:secret@",
        ] {
            match parse_endpoint(url) {
                Err(Error::InvalidUrl { url: shown, .. }) => {
                    assert!(!shown.contains("secret"), "{shown}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn masks_passwords_in_urls() {
        assert_eq!(
            mask_password("redis://app:hunter2@db:6379/0"),
            "redis://app:***@db:6379/0"
        );
        assert_eq!(mask_password("redis://secret@db"), "redis://***@db");
        assert_eq!(mask_password("redis://db:6379"), "redis://db:6379");
        assert_eq!(
            mask_password("redis+sentinel://h:1/m?sentinel_username=u&sentinel_password=pw"),
            "redis+sentinel://h:1/m?sentinel_username=u&sentinel_password=***"
        );
        assert_eq!(
            mask_password("redis+sentinel://u:pw@h:1/m?sentinel_password=x@y"),
            "redis+sentinel://u:***@h:1/m?sentinel_password=***"
        );
        let huge = format!("redis+cluster://{}", "h:1,".repeat(10_000));
        assert_eq!(mask_password(&huge).chars().count(), MAX_ECHOED_URL + 1);
    }
}
