//! The Kafka source against the real broker's SASL_SSL listener (TLS with
//! a CA and broker certificate `cargo xtask kafka` makes at start, SCRAM
//! users it creates): every mechanism reads every record once, and wrong
//! security settings (a wrong password, a CA that did not sign the broker's
//! certificate, a plaintext client on the TLS port) fail within 30 s, for
//! good, with an error that says which setting to check.

use std::time::{Duration, Instant};

use tinyflow_api::{OperatorContext, SourceFactory, StreamError};
use tinyflow_connectors_kafka::testing::{
    Oidc, Secured, bootstrap, create_topic, oidc, produce_stream, secured,
};
use tinyflow_connectors_kafka::{Format, KafkaSource, KafkaSourceConfig};

use crate::kafka_source::fresh_topic as fresh;
use crate::kafka_source_topics::{Rec, assert_once, config, read_bounded, rec};

/// `topic` on the secured listener with `mechanism`, and these settings
/// changed.
fn secured_config(
    topic: &str,
    s: &Secured,
    mechanism: &str,
    change: &[(&str, Option<&str>)],
) -> KafkaSourceConfig {
    let mut c = config(topic, true);
    c.bootstrap_servers = s.bootstrap.clone();
    for (k, v) in [
        ("security.protocol", "SASL_SSL"),
        ("sasl.mechanism", mechanism),
        ("sasl.username", s.username.as_str()),
        ("sasl.password", s.password.as_str()),
        ("ssl.ca.location", s.ca.as_str()),
    ] {
        c.properties.insert(k.to_owned(), v.to_owned());
    }
    for (k, v) in change {
        match v {
            Some(v) => c.properties.insert((*k).to_owned(), (*v).to_owned()),
            None => c.properties.remove(*k),
        };
    }
    c
}

async fn topic_with(n: u64) -> String {
    let topic = fresh("secure");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    produce_stream(
        &bootstrap(),
        &topic,
        &[],
        (0..n).map(|i| ((i % 2) as i32, rec(i))),
    )
    .unwrap();
    topic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sasl_mechanism_over_tls_reads_every_record_once() {
    let s = secured();
    let topic = topic_with(2_000).await;
    for mechanism in ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] {
        let cfg = secured_config(&topic, &s, mechanism, &[]);
        let ids = crate::kafka_source_topics::read_bounded_with(cfg).await;
        assert_once(ids, 0..2_000, &format!("SASL_SSL with {mechanism}"));
    }
    // The same topic over the plaintext listener, for comparison.
    assert_once(read_bounded(&topic).await, 0..2_000, "PLAINTEXT");
}

/// Creates a reader with `cfg`; only whether it failed, and how, matters.
fn create(cfg: KafkaSourceConfig) -> Result<(), StreamError> {
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    KafkaSource::new(cfg, Format::<Rec>::json())
        .create(&ctx, &[])
        .map(drop)
}

/// Creating the reader fails within 30 s, not retryable, and its error
/// contains `says`.
fn fails_saying(cfg: KafkaSourceConfig, says: &str) -> String {
    let started = Instant::now();
    let Err(err) = create(cfg) else {
        panic!("the reader was created");
    };
    let took = started.elapsed();
    let text = tinyflow_api::error_chain(&err);
    assert!(took < Duration::from_secs(30), "took {took:?}: {text}");
    assert!(matches!(err, StreamError::Config { .. }), "{err:?}");
    assert!(!err.is_retryable(), "{text}");
    assert!(text.contains(says), "expected {says:?} in: {text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_within_30_s_saying_so() {
    let s = secured();
    let topic = topic_with(10).await;
    let cfg = secured_config(
        &topic,
        &s,
        "SCRAM-SHA-512",
        &[("sasl.password", Some("not-the-password"))],
    );
    fails_saying(
        cfg,
        "authentication failed: check sasl.mechanism, sasl.username and sasl.password",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_fails_within_30_s_saying_so() {
    let s = secured();
    let topic = topic_with(10).await;
    // Without the test CA, only the system's CAs are trusted.
    let cfg = secured_config(&topic, &s, "SCRAM-SHA-512", &[("ssl.ca.location", None)]);
    fails_saying(
        cfg,
        "the broker's certificate is not trusted: check ssl.ca.location",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_on_the_tls_port_fails_within_30_s_saying_so() {
    let s = secured();
    let topic = topic_with(10).await;
    let cfg = secured_config(
        &topic,
        &s,
        "SCRAM-SHA-512",
        &[
            ("security.protocol", None),
            ("sasl.mechanism", None),
            ("sasl.username", None),
            ("sasl.password", None),
            ("ssl.ca.location", None),
        ],
    );
    fails_saying(cfg, "check security.protocol");
}

/// OAUTHBEARER's settings for the OIDC client-credentials flow against the
/// test identity provider, with `secret` as the client secret.
fn oidc_settings(o: &Oidc, secret: &str) -> Vec<(&'static str, Option<String>)> {
    vec![
        ("sasl.username", None),
        ("sasl.password", None),
        ("sasl.oauthbearer.method", Some("oidc".to_owned())),
        ("sasl.oauthbearer.client.id", Some(o.client_id.clone())),
        ("sasl.oauthbearer.client.secret", Some(secret.to_owned())),
        (
            "sasl.oauthbearer.token.endpoint.url",
            Some(o.token_endpoint()),
        ),
    ]
}

fn oidc_config(topic: &str, s: &Secured, o: &Oidc, secret: &str) -> KafkaSourceConfig {
    let settings = oidc_settings(o, secret);
    let change: Vec<(&str, Option<&str>)> =
        settings.iter().map(|(k, v)| (*k, v.as_deref())).collect();
    secured_config(topic, s, "OAUTHBEARER", &change)
}

/// OAUTHBEARER with the OIDC client-credentials flow, as managed Kafka
/// services offer it: the client fetches a token from a real identity
/// provider (Keycloak), the broker checks its signature with the keys the
/// provider publishes, its issuer and its audience, and every record is
/// read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_client_credentials_read_every_record_once() {
    let (s, o) = (secured(), oidc());
    let topic = topic_with(2_000).await;
    let cfg = oidc_config(&topic, &s, &o, &o.client_secret);
    let ids = crate::kafka_source_topics::read_bounded_with(cfg).await;
    assert_once(ids, 0..2_000, "SASL_SSL with OAUTHBEARER (OIDC)");
}

/// The token lasts 20 s and the broker makes clients log in again every
/// 10 s: a reader that runs for 50 s while the topic is written must renew
/// its token from the identity provider twice or more, or its connection
/// is dropped and it reads nothing after that. It reads every record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oidc_reader_renews_its_token_and_keeps_reading() {
    let (s, o) = (secured(), oidc());
    let topic = fresh("secure-renew");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let n = 500u64;
    let producer = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || {
            produce_stream(
                &bootstrap(),
                &topic,
                &[],
                (0..n).map(|i| {
                    std::thread::sleep(Duration::from_millis(100));
                    ((i % 2) as i32, rec(i))
                }),
            )
        })
    };
    let mut cfg = oidc_config(&topic, &s, &o, &o.client_secret);
    cfg.bounded = false;
    let mut r = crate::kafka_source_topics::reader(cfg);
    let started = Instant::now();
    let mut ids = Vec::new();
    while (ids.len() as u64) < n {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} of {n} records after 120 s",
            ids.len()
        );
        let batch = r
            .next_batch()
            .await
            .unwrap()
            .expect("an unbounded reader never ends");
        ids.extend(batch.into_iter().map(|rec| rec.value.id));
    }
    assert!(
        started.elapsed() > Duration::from_secs(45),
        "{:?}",
        started.elapsed()
    );
    producer.await.unwrap().unwrap();
    assert_once(ids, 0..n, "an OIDC reader over 2.5 token lifetimes");
}

/// A token the identity provider issued for another audience: the broker
/// checks the audience and refuses it, and the reader fails within 30 s,
/// for good, saying so. (This is what shows the broker really checks the
/// tokens the other tests get in with.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_for_another_audience_is_refused_within_30_s_saying_so() {
    let (s, mut o) = (secured(), oidc());
    let topic = topic_with(10).await;
    o.client_id = format!("{}-other-audience", o.client_id);
    let cfg = oidc_config(&topic, &s, &o, &o.client_secret);
    fails_saying(cfg, "the broker refused the OAUTHBEARER token");
}

/// A token endpoint where nothing answers: the reader fails within 30 s,
/// for good, naming the setting to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_identity_provider_fails_within_30_s_saying_so() {
    let (s, mut o) = (secured(), oidc());
    let topic = topic_with(10).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    o.issuer = format!("http://127.0.0.1:{port}/realms/nowhere");
    let cfg = oidc_config(&topic, &s, &o, &o.client_secret);
    fails_saying(
        cfg,
        "no token from the identity provider: check sasl.oauthbearer.token.endpoint.url",
    );
}

/// A client secret the identity provider refuses fails within 30 s, for
/// good, saying which settings to check, and the secret shows nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_oidc_client_secret_fails_within_30_s_saying_so() {
    let (s, o) = (secured(), oidc());
    let topic = topic_with(10).await;
    let secret = "oidc-client-secret-5521";
    let cfg = oidc_config(&topic, &s, &o, secret);
    let text = fails_saying(
        cfg,
        "the identity provider refused the token request: check sasl.oauthbearer.client.id, \
         sasl.oauthbearer.client.secret and sasl.oauthbearer.token.endpoint.url",
    );
    assert!(!text.contains(secret), "{text}");
}
