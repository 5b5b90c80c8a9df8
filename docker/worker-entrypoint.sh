#!/bin/sh
# Entrypoint of the worker image: shape this container's link if asked, then run the
# command as the unprivileged user `stella` (as root only with STELLA_RUN_AS_ROOT=1).
#
#   STELLA_SHAPE_RATE   e.g. 20mbit: a token bucket (tbf) on egress, the site's uplink,
#                       and, where the kernel has the police action and the u32
#                       classifier, a policer on ingress, its downlink; needs NET_ADMIN
#   STELLA_SHAPE_DELAY  e.g. 20ms: one-way delay added to egress (netem), where the
#                       kernel has netem
#   STELLA_SHAPE_DEV    the interface (default eth0)
# The uplink's token bucket must work (the container fails otherwise); the policer and
# the delay are best effort, and a line on stderr says what this kernel lacked.
set -eu
if [ -n "${STELLA_SHAPE_RATE:-}" ]; then
    dev=${STELLA_SHAPE_DEV:-eth0}
    burst=${STELLA_SHAPE_BURST:-64kb}
    done="uplink $STELLA_SHAPE_RATE"
    if [ -n "${STELLA_SHAPE_DELAY:-}" ] && \
       tc qdisc replace dev "$dev" root handle 1: netem delay "$STELLA_SHAPE_DELAY" 2>/dev/null; then
        tc qdisc replace dev "$dev" parent 1:1 handle 10: tbf rate "$STELLA_SHAPE_RATE" burst "$burst" latency 100ms
        done="$done +$STELLA_SHAPE_DELAY"
    else
        [ -z "${STELLA_SHAPE_DELAY:-}" ] || echo "stella-worker: no delay: this kernel has no netem" >&2
        tc qdisc replace dev "$dev" root tbf rate "$STELLA_SHAPE_RATE" burst "$burst" latency 100ms
    fi
    if tc qdisc replace dev "$dev" handle ffff: ingress 2>/dev/null && \
       tc filter replace dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 \
           police rate "$STELLA_SHAPE_RATE" burst "$burst" drop flowid :1 2>/dev/null; then
        done="$done, downlink $STELLA_SHAPE_RATE"
    else
        tc qdisc del dev "$dev" handle ffff: ingress 2>/dev/null || true
        echo "stella-worker: downlink not shaped: this kernel lacks the police action or the u32 classifier" >&2
    fi
    echo "stella-worker: $dev shaped: $done" >&2
fi
if [ "$(id -u)" = 0 ] && [ "${STELLA_RUN_AS_ROOT:-0}" != 1 ]; then
    exec setpriv --reuid=stella --regid=stella --init-groups --inh-caps=-all -- "$@"
fi
exec "$@"
