"""kvpilot's Kubernetes operator: reconciles `InferenceService` objects into serving pods.

Imports no torch: the operator image installs `kvpilot[operator]` only.
"""
