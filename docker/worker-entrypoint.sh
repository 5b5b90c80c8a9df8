#!/bin/sh
# Entrypoint of the worker image: shape this container's link if asked, then run the
# command as the unprivileged user `stella` (as root only with STELLA_RUN_AS_ROOT=1).
#
#   STELLA_SHAPE_RATE   e.g. 20mbit: egress (uplink) token bucket and ingress
#                       (downlink) policer at this rate; needs cap_add NET_ADMIN
#   STELLA_SHAPE_DELAY  e.g. 20ms: one-way delay added to egress (netem; optional)
#   STELLA_SHAPE_DEV    the interface (default eth0)
set -eu
if [ -n "${STELLA_SHAPE_RATE:-}" ]; then
    dev=${STELLA_SHAPE_DEV:-eth0}
    burst=${STELLA_SHAPE_BURST:-64kb}
    if [ -n "${STELLA_SHAPE_DELAY:-}" ]; then
        tc qdisc replace dev "$dev" root handle 1: netem delay "$STELLA_SHAPE_DELAY"
        tc qdisc replace dev "$dev" parent 1:1 handle 10: tbf rate "$STELLA_SHAPE_RATE" burst "$burst" latency 100ms
    else
        tc qdisc replace dev "$dev" root tbf rate "$STELLA_SHAPE_RATE" burst "$burst" latency 100ms
    fi
    tc qdisc replace dev "$dev" handle ffff: ingress
    tc filter replace dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 \
        police rate "$STELLA_SHAPE_RATE" burst "$burst" drop flowid :1
    echo "stella-worker: $dev shaped to $STELLA_SHAPE_RATE each way${STELLA_SHAPE_DELAY:+, +$STELLA_SHAPE_DELAY}" >&2
fi
if [ "$(id -u)" = 0 ] && [ "${STELLA_RUN_AS_ROOT:-0}" != 1 ]; then
    exec setpriv --reuid=stella --regid=stella --init-groups --inh-caps=-all -- "$@"
fi
exec "$@"
