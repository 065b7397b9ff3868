//! The shared holders' operations (see [`SharedModes`](crate::node::SharedModes)): one
//! script each. Every key of a resource shares its hash tag, so a Cluster routes each
//! whole to one master.

use super::acquire::{acquire_granted, parse_acquire};
use super::*;
use crate::node::resource::LIMIT_SUFFIX;
use crate::node::SharedRequest;

static SHARED_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/fence_rule.lua"),
        include_str!("../scripts/shared_acquire.lua")
    ))
});
static SHARED_EXTEND: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../scripts/shared_extend.lua")));
static SHARED_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/hand_off.lua"),
        include_str!("../scripts/shared_release.lua")
    ))
});

/// The owned arguments of one shared acquire (`shared_acquire.lua`).
pub(crate) struct SharedAcquireCall(Call);

impl SharedAcquireCall {
    pub(crate) fn new(request: &SharedRequest<'_>) -> Self {
        let keys = request.keys;
        let limit = request.mode.limit().map_or(0, |n| n.get());
        SharedAcquireCall(
            Call::new(&SHARED_ACQUIRE, 5)
                .arg(&keys.lock)
                .arg(&keys.fence)
                .arg(keys.queue())
                .arg(keys.writer())
                .arg(Suffixed(&keys.lock, LIMIT_SUFFIX))
                .arg(request.owner.as_str())
                .arg(millis_ceil(request.ttl))
                .arg(millis_ceil(request.fence_ttl))
                .arg(request.fence_floor)
                .arg(if request.fencing { "1" } else { "0" })
                .arg(limit),
        )
    }
}

/// With `wait`, a grant counts only once enough replicas acknowledged it.
impl Op for SharedAcquireCall {
    type Output = AcquireReply;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<AcquireReply, CallError> {
        let value = self.0.run(conn, wait, acquire_granted).await?;
        parse_acquire(&value).map_err(CallError::Reply)
    }
}

/// One shared extend (`shared_extend.lua`): answered as the exclusive extend is, so it
/// is an [`ExtendCall`] with another script.
pub(crate) fn extend_shared(keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> ExtendCall {
    ExtendCall(
        Call::new(&SHARED_EXTEND, 2)
            .arg(&keys.lock)
            .arg(Suffixed(&keys.lock, LIMIT_SUFFIX))
            .arg(owner.as_str())
            .arg(millis_ceil(ttl)),
    )
}

/// One shared release (`hand_off.lua`, `shared_release.lua`): answered as the exclusive
/// release is, so it is a [`ReleaseCall`] with another script. `sharded`: the node
/// publishes with `SPUBLISH` (Redis Cluster).
pub(crate) fn release_shared(keys: &ResourceKeys, owner: &Owner, sharded: bool) -> ReleaseCall {
    ReleaseCall(
        Call::new(&SHARED_RELEASE, 2)
            .arg(&keys.lock)
            .arg(keys.queue())
            .arg(owner.as_str())
            .arg(&keys.channel)
            .arg(if sharded { "1" } else { "0" })
            .arg(millis_ceil(HANDOFF_TTL)),
    )
}
