"""moeadapt.data"""
