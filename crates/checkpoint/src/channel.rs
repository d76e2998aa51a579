//! The coordinator's link to one task: [`ControlChannel`].
//!
//! A control channel is bounded. A full channel is backpressure, not failure:
//! the coordinator keeps the message and delivers it when the task has room
//! (through [`ControlChannel::send`]), while it goes on handling acks and
//! timers. A closed channel means the task is gone.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::ToTask;

/// A boxed, sendable, `'static` future, as returned by [`ControlChannel`].
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The task at the other end is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("control channel closed")]
pub struct ChannelClosed;

/// Why [`ControlChannel::try_send`] did not deliver; the message comes back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrySendError {
    /// The channel is full (the task is busy): try again later.
    #[error("control channel full")]
    Full(ToTask),
    /// The task is gone.
    #[error("control channel closed")]
    Closed(ToTask),
}

/// The sending half of one task's control channel, as the coordinator sees it.
///
/// Implemented for `tokio::sync::mpsc::Sender<ToTask>`; a remote task would
/// implement it over its transport.
pub trait ControlChannel: Send + Sync + fmt::Debug {
    /// Delivers `msg` now if there is room.
    fn try_send(&self, msg: ToTask) -> Result<(), TrySendError>;

    /// Delivers `msg` once there is room. The returned future owns what it
    /// needs; dropping it before it completes drops `msg` undelivered (it is
    /// cancel safe in that nothing else is lost).
    fn send(&self, msg: ToTask) -> BoxFuture<Result<(), ChannelClosed>>;

    /// Completes when the task side is gone (its receiver was dropped).
    fn closed(&self) -> BoxFuture<()>;
}

impl ControlChannel for tokio::sync::mpsc::Sender<ToTask> {
    fn try_send(&self, msg: ToTask) -> Result<(), TrySendError> {
        use tokio::sync::mpsc::error::TrySendError as E;
        tokio::sync::mpsc::Sender::try_send(self, msg).map_err(|e| match e {
            E::Full(m) => TrySendError::Full(m),
            E::Closed(m) => TrySendError::Closed(m),
        })
    }

    fn send(&self, msg: ToTask) -> BoxFuture<Result<(), ChannelClosed>> {
        let tx = self.clone();
        Box::pin(async move { tx.send(msg).await.map_err(|_| ChannelClosed) })
    }

    fn closed(&self) -> BoxFuture<()> {
        let tx = self.clone();
        Box::pin(async move { tx.closed().await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinyflow_api::CheckpointId;

    fn notify(n: u64) -> ToTask {
        ToTask::NotifyComplete {
            id: CheckpointId::new(n),
        }
    }

    #[tokio::test]
    async fn tokio_sender_reports_full_then_delivers_when_room() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<ToTask>(1);
        let chan: &dyn ControlChannel = &tx;
        chan.try_send(notify(1)).unwrap();
        assert_eq!(chan.try_send(notify(2)), Err(TrySendError::Full(notify(2))));
        let pending = chan.send(notify(2));
        assert_eq!(rx.recv().await, Some(notify(1)));
        pending.await.unwrap();
        assert_eq!(rx.recv().await, Some(notify(2)));
    }

    #[tokio::test]
    async fn tokio_sender_reports_closed() {
        let (tx, rx) = tokio::sync::mpsc::channel::<ToTask>(1);
        let closed = ControlChannel::closed(&tx);
        drop(rx);
        closed.await;
        assert_eq!(
            ControlChannel::try_send(&tx, notify(1)),
            Err(TrySendError::Closed(notify(1)))
        );
        assert_eq!(
            ControlChannel::send(&tx, notify(1)).await,
            Err(ChannelClosed)
        );
    }
}
