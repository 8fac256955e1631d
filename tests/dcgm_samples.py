# ruff: noqa: E501  (exporter lines are quoted whole)
"""dcgm-exporter expositions for the dcgm tests.

``REAL_*``: lines quoted verbatim from output users posted in NVIDIA/dcgm-exporter issues (label
order, label names and values exactly as printed there; the issue is named on each). ``node()``
renders a SYNTHETIC node in dcgm-exporter's own template (internal/pkg/rendermetrics/
render_metrics.go: ``gpu, UUID, pci_bus_id, device, modelName[, GPU_I_PROFILE, GPU_I_ID][, Hostname]``
then the pod labels), with made-up values.
"""

from __future__ import annotations

from typing import Any

REAL_MIG_H100_PODS = """\
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77",pci_bus_id="00000000:1A:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="7",Hostname="gsrh100-074",DCGM_FI_DRIVER_VERSION="535.129.03",container="kserve-container",namespace="model-playground-stg",pod="text-embedding-predictor-00008-deployment-57946f6c67-vdtjl"} 0.000000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77",pci_bus_id="00000000:1A:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="8",Hostname="gsrh100-074",DCGM_FI_DRIVER_VERSION="535.129.03"} 0.000000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77",pci_bus_id="00000000:1A:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="gsrh100-074",DCGM_FI_DRIVER_VERSION="535.129.03",container="kserve-container",namespace="model-playground-stg",pod="tts-predictor-00011-deployment-5554f75554-8j8pl"} 0.000000
"""
"""NVIDIA/dcgm-exporter#512 (H100 in MIG mode, kserve pods on two 1g.10gb instances; FB fields missing there)."""

REAL_MIG_A30_FB = """\
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-265c9814-6156-355b-e589-ff2064894f16",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-265c9814-6156-355b-e589-ff2064894f16",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="4",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-265c9814-6156-355b-e589-ff2064894f16",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="5",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-265c9814-6156-355b-e589-ff2064894f16",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="6",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49",device="nvidia1",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49",device="nvidia1",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="4",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 3
"""
"""NVIDIA/dcgm-exporter#317 (two A30s, each split into 1g.6gb instances)."""

REAL_MIG_A100_WHOLE = """\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-06357e72-c3ee-614b-775f-a89e18e8cc08",device="nvidia0",modelName="NVIDIA A100 80GB PCIe",GPU_I_PROFILE="7g.79gb",GPU_I_ID="0",Hostname="metal-gpu-08",DCGM_FI_DRIVER_VERSION="535.154.05",container="",namespace="",pod=""} 1410
"""
"""NVIDIA/dcgm-exporter#713 (an A100 as one all-7g MIG instance: GPU_I_ID 0 is an instance, not 'no instance')."""

REAL_OLD_NAMESPACE_MIG = """\
dcgm_fi_prof_gr_engine_active{gpu="0",uuid="GPU-ed1353d6-52ba-8793-7230-4d5d3eb68167",device="nvidia0",modelName="NVIDIA A100 80GB PCIe",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",container_name="",pod_name="",pod_namespace=""} 0.000000
dcgm_fi_prof_gr_engine_active{gpu="0",uuid="GPU-ed1353d6-52ba-8793-7230-4d5d3eb68167",device="nvidia0",modelName="NVIDIA A100 80GB PCIe",GPU_I_PROFILE="4g.40gb",GPU_I_ID="2",container_name="",pod_name="",pod_namespace=""} 0.000000
dcgm_fi_prof_gr_engine_active{gpu="1",uuid="GPU-6043e4b2-feaa-8010-34c7-61d1a01576bb",device="nvidia1",modelName="NVIDIA A100 80GB PCIe",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",container_name="",pod_name="",pod_namespace=""} 0.000000
"""
"""NVIDIA/dcgm-exporter#272 (``--use-old-namespace``: ``uuid``, ``pod_name``/``pod_namespace``/``container_name``;
the metric names lower-cased by that user's setup)."""

REAL_POD_HOSTNAME_MIXED = """\
# HELP DCGM_FI_DEV_DEC_UTIL Ratio of time the decoder is active (in %).
# TYPE DCGM_FI_DEV_DEC_UTIL gauge
DCGM_FI_DEV_DEC_UTIL{gpu="1",UUID="GPU-fc60126e-514d-3522-2828-c5daa8e99d85",pci_bus_id="00000000:B1:00.0",device="nvidia1",modelName="NVIDIA RTX 2000 Ada Generation",hostname="dcgm-exporter-wwwjh"} 46
# HELP DCGM_FI_DEV_ENC_UTIL Ratio of time the encoder is active (in %).
# TYPE DCGM_FI_DEV_ENC_UTIL gauge
DCGM_FI_DEV_ENC_UTIL{gpu="1",UUID="GPU-fc60126e-514d-3522-2828-c5daa8e99d85",pci_bus_id="00000000:B1:00.0",device="nvidia1",modelName="NVIDIA RTX 2000 Ada Generation",hostname="dcgm-exporter-wwwjh"} 9
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-fc60126e-514d-3522-2828-c5daa8e99d85",pci_bus_id="00000000:B1:00.0",device="nvidia1",modelName="NVIDIA RTX 2000 Ada Generation",hostname="dcgm-exporter-wwwjh"} 11275
DCGM_FI_DEV_FB_FREE{gpu="2",UUID="GPU-63bc0b91-2265-1b94-831c-15c41fe92675",pci_bus_id="00000000:CA:00.0",device="nvidia2",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",hostname="dcgm-exporter-wwwjh",container="triton-server",namespace="default",pod="triton-server-f7cb5d77-95xcf"} 2207
"""
"""NVIDIA/dcgm-exporter PR #736 thread (a mixed node: an RTX 2000 whole and an A30 MIG instance used by
a Triton pod; no NODE_NAME, so the hostname label is the exporter's pod name)."""

REAL_UNMAPPED_ONLY = """\
# HELP DCGM_FI_DEV_DEC_UTIL Ratio of time the decoder is active (in %).
# TYPE DCGM_FI_DEV_DEC_UTIL gauge
DCGM_FI_DEV_DEC_UTIL{gpu="1",UUID="GPU-fc60126e-514d-3522-2828-c5daa8e99d85",pci_bus_id="00000000:B1:00.0",device="nvidia1",modelName="NVIDIA RTX 2000 Ada Generation",hostname="dcgm-exporter-wwwjh"} 46
# HELP DCGM_FI_DEV_ENC_UTIL Ratio of time the encoder is active (in %).
# TYPE DCGM_FI_DEV_ENC_UTIL gauge
DCGM_FI_DEV_ENC_UTIL{gpu="1",UUID="GPU-fc60126e-514d-3522-2828-c5daa8e99d85",pci_bus_id="00000000:B1:00.0",device="nvidia1",modelName="NVIDIA RTX 2000 Ada Generation",hostname="dcgm-exporter-wwwjh"} 9
"""
"""The first two families of the PR #736 output: DCGM series, none of them one triscope maps."""

_HELP = {
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
}


def node(hostname: str, gpus: list[dict[str, Any]], driver: str = "570.124.06") -> str:
    """A SYNTHETIC dcgm-exporter -k exposition: ``gpus`` items hold ``gpu``, ``uuid``, ``model``, optional
    ``mig`` = (profile, id), optional ``pod`` = (pod, namespace, container) and the values per field."""
    lines = []
    for field, (kind, text) in _HELP.items():
        lines += [f"# HELP {field} {text}", f"# TYPE {field} {kind}"]
        for g in gpus:
            if field not in g:
                continue
            labels = (f'gpu="{g["gpu"]}",UUID="{g["uuid"]}",pci_bus_id="00000000:{0x18 + int(g["gpu"]):02X}:00.0",'
                      f'device="nvidia{g["gpu"]}",modelName="{g["model"]}"')
            if "mig" in g:
                profile, iid = g["mig"]
                labels += f',GPU_I_PROFILE="{profile}",GPU_I_ID="{iid}"'
            labels += f',Hostname="{hostname}",DCGM_FI_DRIVER_VERSION="{driver}"'
            if "pod" in g:
                pod, ns, container = g["pod"]
                labels += f',container="{container}",namespace="{ns}",pod="{pod}"'
            lines.append(f"{field}{{{labels}}} {g[field]}")
    return "\n".join(lines) + "\n"
