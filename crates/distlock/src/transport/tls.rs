//! TLS, which the `tls` feature (on by default) brings: rustls with the web's root
//! certificates, and certificates of the caller's own
//! ([`ClientBuilder::tls_certificates`](crate::ClientBuilder::tls_certificates)).
//!
//! rustls needs a process-wide crypto provider, and redis-rs does not pick one. distlock
//! installs ring's the first time a client connects to a TLS deployment, unless the
//! application installed a provider before: a client that never uses TLS installs nothing,
//! so an application may still choose its own provider later.
//!
//! Built without the feature, a TLS URL is refused with [`Error::InvalidUrl`] and the
//! certificates type is empty, so no code path can hold one.

use crate::config::Certificates;
use crate::error::{Error, Result};

/// True if `info` is a TLS address (`rediss://`).
pub(crate) fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

/// Gets ready for connections to `target`, which use TLS if `tls`: installs the crypto
/// provider then, or refuses when built without TLS.
pub(crate) fn prepare(target: &str, tls: bool) -> Result<()> {
    if !tls {
        return Ok(());
    }
    #[cfg(feature = "tls")]
    {
        let _ = target;
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Another thread may win the race to install one; either way one is set.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        Ok(())
    }
    #[cfg(not(feature = "tls"))]
    Err(Error::InvalidUrl {
        url: target.to_owned(),
        reason: "a TLS deployment, but distlock was built without its `tls` feature".into(),
    })
}

/// Refuses certificates that could never verify a server: unparsable PEM, or a root
/// certificate with no certificate in it (redis-rs would trust nothing, and every connect
/// would fail later with a vaguer error).
pub(crate) fn check(certificates: &Certificates) -> Result<()> {
    #[cfg(feature = "tls")]
    {
        const PEM_CERTIFICATE: &[u8] = b"-----BEGIN CERTIFICATE-----";
        let invalid = |reason: String| Error::InvalidConfig {
            what: "TLS certificates",
            reason,
        };
        if let Some(root) = &certificates.root_cert {
            if !root
                .windows(PEM_CERTIFICATE.len())
                .any(|window| window == PEM_CERTIFICATE)
            {
                return Err(invalid(
                    "the root certificate holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
                        .into(),
                ));
            }
        }
        redis::Client::build_with_tls("rediss://127.0.0.1/", certificates.clone())
            .map(drop)
            .map_err(|err| invalid(err.to_string()))
    }
    #[cfg(not(feature = "tls"))]
    match *certificates {}
}

/// `info` with `certificates` built in.
pub(crate) fn with_certificates(
    info: redis::ConnectionInfo,
    certificates: &Certificates,
) -> redis::RedisResult<redis::ConnectionInfo> {
    #[cfg(feature = "tls")]
    {
        redis::Client::build_with_tls(info, certificates.clone())
            .map(|client| client.get_connection_info().clone())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = info;
        match *certificates {}
    }
}

#[cfg(feature = "cluster")]
/// A cluster client builder that connects to every node it discovers with `certificates`.
pub(crate) fn for_cluster(
    builder: redis::cluster::ClusterClientBuilder,
    certificates: &Certificates,
) -> redis::cluster::ClusterClientBuilder {
    #[cfg(feature = "tls")]
    {
        builder.certs(certificates.clone())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = builder;
        match *certificates {}
    }
}

#[cfg(feature = "sentinel")]
/// A sentinel client builder that uses TLS, with `certificates` if given, for the
/// sentinels and the master.
pub(crate) fn for_sentinel(
    builder: redis::sentinel::SentinelClientBuilder,
    certificates: Option<&Certificates>,
) -> redis::sentinel::SentinelClientBuilder {
    let builder = builder
        .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
        .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
    match certificates {
        None => builder,
        #[cfg(feature = "tls")]
        Some(certificates) => builder
            .set_client_to_redis_certificates(certificates.clone())
            .set_client_to_sentinel_certificates(certificates.clone()),
        #[cfg(not(feature = "tls"))]
        Some(certificates) => match *certificates {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "tls"))]
    #[test]
    fn without_the_feature_a_tls_deployment_is_refused() {
        assert!(prepare("redis://127.0.0.1:6379", false).is_ok());
        let err = prepare("rediss://127.0.0.1:6379", true).unwrap_err();
        assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("`tls` feature"), "{err}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn a_rediss_url_is_tls() {
        let tls = redis::IntoConnectionInfo::into_connection_info("rediss://127.0.0.1:6380/");
        let plain = redis::IntoConnectionInfo::into_connection_info("redis://127.0.0.1:6379/");
        assert!(tls.is_ok_and(|info| is_tls(&info)));
        assert!(plain.is_ok_and(|info| !is_tls(&info)));
    }
}
