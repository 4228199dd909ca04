//! rustls' process-wide crypto provider (issue 21): `connect` installed ring's on every
//! call, even for `redis://`, so an application that installed its own afterwards got an
//! error. Now a client installs nothing unless a TLS connection needs it, and never
//! replaces a provider the application chose. Its own test binary: the provider is
//! process-wide.

mod common;

use std::sync::Arc;
use std::time::Duration;

use distlock::Client;
use rustls::crypto::CryptoProvider;

#[tokio::test]
async fn only_tls_installs_a_crypto_provider_and_never_over_the_applications() {
    let server = common::server().await;
    let client = Client::connect(&server.url()).await.unwrap();
    common::lock_once(&client, "plain").await;
    assert!(
        CryptoProvider::get_default().is_none(),
        "a redis:// client installed a crypto provider"
    );

    // The application picks its own now, as it may at any time.
    rustls::crypto::ring::default_provider()
        .install_default()
        .expect("nothing was installed before the application's");
    let installed = CryptoProvider::get_default().expect("installed").clone();

    // A TLS connection (to a port with no server: it fails, after getting ready) keeps
    // the application's provider.
    let port = distlock_testkit::pick_free_port().unwrap();
    let attempt = Client::builder()
        .connection_timeout(Duration::from_millis(500))
        .connect(&format!("rediss://127.0.0.1:{port}/"))
        .await;
    assert!(attempt.is_err());
    let after = CryptoProvider::get_default().expect("still installed");
    assert!(
        Arc::ptr_eq(&installed, after),
        "distlock replaced the provider"
    );
}
