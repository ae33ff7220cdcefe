"""The built-in provisioner backends by name, free of imports.

``gpu.provisioners.registry`` resolves them; ``gpu.models`` validates ``Region.provisioner`` against
the names without importing the provisioners (they import the models).
"""

from __future__ import annotations

PROVISIONER_BACKENDS: dict[str, str] = {
    "local": "gpu.provisioners.local:LocalProvisioner",
    "kubernetes": "gpu.provisioners.kubernetes:KubernetesProvisioner",
    "static": "gpu.provisioners.static:StaticProvisioner",
}
