"""node/mesh"""
