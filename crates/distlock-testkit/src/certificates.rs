//! A private certificate authority for TLS tests: a CA and one certificate for 127.0.0.1
//! it signed, usable as a server's and as a client's, made with the openssl command.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::TestkitError;

/// The files [`write_test_certificates`] made.
#[derive(Debug, Clone)]
pub struct TestCertificates {
    /// The CA's certificate (PEM): what a client or a server trusts.
    pub ca: PathBuf,
    /// A certificate for 127.0.0.1 the CA signed (PEM).
    pub cert: PathBuf,
    /// That certificate's private key (PEM, unencrypted).
    pub key: PathBuf,
}

/// Writes `ca.crt`, `ca.key`, `server.crt` and `server.key` into `dir`. The certificates
/// are valid for one day.
pub fn write_test_certificates(dir: &Path) -> Result<TestCertificates, TestkitError> {
    let openssl = |args: &[&str]| -> Result<(), TestkitError> {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| TestkitError::Io {
                context: "running openssl (./dev test installs it)".into(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(TestkitError::Io {
                context: format!("openssl {args:?}"),
                source: std::io::Error::other(format!("exited with {status}")),
            })
        }
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=distlock test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ])?;
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ])?;
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").map_err(|source| {
        TestkitError::Io {
            context: "writing san.ext".into(),
            source,
        }
    })?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ])?;
    Ok(TestCertificates {
        ca: dir.join("ca.crt"),
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
    })
}

impl TestCertificates {
    /// Starts a redis-server that serves TLS with these certificates on a free port, as
    /// well as plain TCP on its usual one; with `auth_clients`, it asks every client for a
    /// certificate the CA signed. Returns the server and its TLS port.
    pub async fn start_server(
        &self,
        auth_clients: bool,
    ) -> Result<(crate::RedisServer, u16), TestkitError> {
        let tls_port = crate::pick_free_port()?;
        let port = tls_port.to_string();
        let path = |file: &PathBuf| file.display().to_string();
        let (cert, key, ca) = (path(&self.cert), path(&self.key), path(&self.ca));
        let server = crate::RedisServer::start_with_args(&[
            "--tls-port",
            &port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ])
        .await?;
        Ok((server, tls_port))
    }
}
