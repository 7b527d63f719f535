"""Instability diagnosis (needs torch): the article's troubleshooting sequence (§5.3), automated.

``diagnose(setup)`` trains the same steps in fp32 and in the chosen precision from the same weights, scans
activations and gradients against the format's limits, locates the first NaN/Inf, tries a lower learning
rate and clipping, scans the data, and returns a :class:`DoctorReport` with typed findings and a diagnosis.
"""

from trainfit.doctor.core import DoctorConfig, DoctorReport, diagnose, diagnose_target
from trainfit.doctor.findings import DoctorError, Finding, FindingKind
from trainfit.doctor.setup import DoctorSetup, load_setup

__all__ = [
    "DoctorConfig",
    "DoctorError",
    "DoctorReport",
    "DoctorSetup",
    "Finding",
    "FindingKind",
    "diagnose",
    "diagnose_target",
    "load_setup",
]
