"""Stored Responses (`store: true`, `previous_response_id`): kept with their conversation across the mesh
(node.responses.service says how)."""
