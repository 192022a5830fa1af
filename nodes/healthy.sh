#!/bin/sh
# Health check: the node's zbus process touches ZBUS_HEALTH_FILE at every heartbeat.
f="${ZBUS_HEALTH_FILE:-/tmp/zbus-health}"
[ -f "$f" ] && [ $(( $(date +%s) - $(stat -c %Y "$f") )) -lt "${1:-15}" ]
