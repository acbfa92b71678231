"""Running models on the QNN HTP (the x86_64 simulator on a build machine) from any stage.

QNN can abort the whole process from native code or hang (FACTS §4), so everything here runs in
a child process with a time limit (``isolation``). ``probe`` compiles a QDQ model for one chip,
runs it on the HTP and compares it with the CPU: the quantize stage uses it to judge precision
and range choices by what the NPU computes, and to find the first tensor where the HTP and the
CPU QDQ model part ways.
"""
