"""Ray Serve glue: `serve run shoal.serve_ray:build_app model=MODEL num_replicas=2` (see
`shoal.entrypoints.serve_ray`)."""

from shoal.entrypoints.serve_ray import ShoalReplica, build_app, deployment

__all__ = ["ShoalReplica", "build_app", "deployment"]
