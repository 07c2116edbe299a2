"""Links to files of src/gpufleet/deviceplugin. The collection shares code with the package only
through such links, to files that import nothing beyond the standard library, PyYAML and each other
(docs/architecture.md)."""
