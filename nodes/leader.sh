#!/bin/sh
# The leader node: runs the demo driver, which leads the cluster of ZBUS_NNODES
# nodes at ZBUS_MASTER_ADDR (this node's name on the cluster network).
set -e
exec zbus demo --nnodes "${ZBUS_NNODES:-3}" --master-addr "${ZBUS_MASTER_ADDR:-leader}" "$@"
