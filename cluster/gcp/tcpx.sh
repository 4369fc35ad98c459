#!/usr/bin/env bash
# GPUDirect-TCPX on an a3-highgpu-8g host, run by cluster/gcp.yaml (the gpu type's
# initialization_commands) before Ray's container starts:
# 1. writes /run/tcpx/nccl.env, NCCL's settings from Google's TCPX release for A3 High, with this
#    VM's own interface names (nic0: the one with the default route; nic1-4: the other four PCI
#    network devices, in name order); the container reads it (docker --env-file);
# 2. installs the NCCL TCPX plugin into /var/lib/tcpx/lib64, mounted into the container at
#    /usr/local/tcpx/lib64 and named there by NCCL_NET_PLUGIN (the folder stays off the library
#    path: the older NCCL core beside the plugin must not replace torch's);
# 3. starts the receive-datapath manager (RxDM), its socket in /run/tcpx.
# Plugin and RxDM are released in pairs (GoogleCloudPlatform/container-engine-accelerators,
# gpudirect-tcpx/README.md): change both together. TCPX_ENV_ONLY=1 stops after step 1;
# TCPX_SYSFS, TCPX_PROCFS and TCPX_DIR stand in for /sys, /proc and /run/tcpx (TCPX_SETTLE_S: how
# long the manager must stay up, 10 s).
set -euo pipefail
PLUGIN=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev:v3.1.12
RXDM=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.15
sys="${TCPX_SYSFS:-/sys}"; proc="${TCPX_PROCFS:-/proc}"; dir="${TCPX_DIR:-/run/tcpx}"

ctrl="$(awk 'NR > 1 && $2 == "00000000" {print $1; exit}' "$proc/net/route")"
[[ -n "$ctrl" ]] || { echo "tcpx.sh: no default route in $proc/net/route: which NIC is nic0?" >&2; exit 1; }
data=()
for path in "$sys"/class/net/*; do
  name="${path##*/}"
  [[ -e "$path/device" && "$name" != "$ctrl" ]] && data+=("$name")
done
(( ${#data[@]} == 0 )) || mapfile -t data < <(printf '%s\n' "${data[@]}" | sort -V)
if (( ${#data[@]} != 4 )); then
  echo "tcpx.sh: an a3-highgpu-8g has 4 GPU NICs besides $ctrl, found ${#data[@]} (${data[*]}):" \
       "give the gpu node type the four extra networkInterfaces of cluster/gcp.yaml" >&2
  exit 1
fi
n1="${data[0]}" n2="${data[1]}" n3="${data[2]}" n4="${data[3]}"

if [[ ! -d "$dir" ]]; then sudo mkdir -p "$dir"; sudo chown "$(id -u):$(id -g)" "$dir"; fi
cat > "$dir/nccl.env" <<EOF
NCCL_NET_PLUGIN=/usr/local/tcpx/lib64/libnccl-net.so
NCCL_SOCKET_IFNAME=$ctrl
NCCL_GPUDIRECTTCPX_CTRL_DEV=$ctrl
NCCL_GPUDIRECTTCPX_SOCKET_IFNAME=$n1,$n2,$n3,$n4
NCCL_GPUDIRECTTCPX_TX_BINDINGS=$n1:8-21,112-125;$n2:8-21,112-125;$n3:60-73,164-177;$n4:60-73,164-177
NCCL_GPUDIRECTTCPX_RX_BINDINGS=$n1:22-35,126-139;$n2:22-35,126-139;$n3:74-87,178-191;$n4:74-87,178-191
NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS=500000
NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX=/run/tcpx
NCCL_ALGO=Ring,Tree
NCCL_PROTO=Simple
NCCL_CROSS_NIC=0
NCCL_NET_GDR_LEVEL=PIX
NCCL_P2P_PXN_LEVEL=0
NCCL_DYNAMIC_CHUNK_SIZE=524288
NCCL_P2P_NET_CHUNKSIZE=524288
NCCL_P2P_PCI_CHUNKSIZE=524288
NCCL_P2P_NVL_CHUNKSIZE=1048576
NCCL_BUFFSIZE=4194304
NCCL_NSOCKS_PERTHREAD=4
NCCL_SOCKET_NTHREADS=1
EOF
echo "tcpx.sh: nic0 $ctrl, GPU NICs $n1 $n2 $n3 $n4 -> $dir/nccl.env"
[[ -z "${TCPX_ENV_ONLY:-}" ]] || exit 0

# Ray runs this again whenever the cluster's config changes, maybe under a running job: a manager
# already running the pinned image is left alone. (A changed nccl.env reaches Ray's container only
# when Ray starts it anew: it restarts a container for a new image or mounts, not for new options.)
if [[ "$(docker inspect -f '{{.Config.Image}} {{.State.Running}}' receive-datapath-manager 2>/dev/null)" == "$RXDM true" ]]; then
  echo "tcpx.sh: receive-datapath-manager already running $RXDM"
  exit 0
fi
gcloud auth configure-docker us-docker.pkg.dev --quiet
docker run --rm --volume /var/lib:/var/lib "$PLUGIN" install --install-nccl
docker rm -f receive-datapath-manager >/dev/null 2>&1 || true
docker run --detach --restart unless-stopped --name receive-datapath-manager --privileged --cap-add=NET_ADMIN \
  --network=host --gpus all --volume "$dir:/run/tcpx" --entrypoint /tcpgpudmarxd/build/app/tcpgpudmarxd "$RXDM" \
  --gpu_nic_preset a3vm --gpu_shmem_type fd --uds_path /run/tcpx --setup_param "--verbose 128 2 0" >/dev/null
# `docker run --detach` succeeds even when the daemon dies at once: look again after it settled
sleep "${TCPX_SETTLE_S:-10}"
if [[ "$(docker inspect -f '{{.State.Running}} {{.RestartCount}}' receive-datapath-manager)" != "true 0" ]]; then
  echo "tcpx.sh: receive-datapath-manager did not stay up; its log:" >&2
  docker logs --tail 20 receive-datapath-manager >&2 || true
  exit 1
fi
echo "tcpx.sh: receive-datapath-manager running $RXDM"
