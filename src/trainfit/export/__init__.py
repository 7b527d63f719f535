"""Configuration files for a plan, in the formats the engines read (``trainfit plan --export DIR``)."""

from trainfit.export.configs import Export, export_files, export_plan, layer_class, write_export

__all__ = ["Export", "export_files", "export_plan", "layer_class", "write_export"]
