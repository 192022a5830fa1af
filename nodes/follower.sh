#!/bin/sh
# A follower node: joins the leader named by ZBUS_MASTER_ADDR (ZBUS_MASTER_PORT,
# ZBUS_NPROC_PER_NODE, ZBUS_NODE_RANK) and runs this node's workers.
set -e
exec zbus follower "$@"
